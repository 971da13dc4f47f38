"""Expert parallelism in `stp plan`: each configuration's model, hardware and bounds.

The planner searches ep as a mesh axis (`stp.plan.space.ep_options`: the
divisors of dp that divide the experts). A configuration at ep is priced on
the model at that ep (`model_at`): `stp.costmodel.memory` then holds 1/ep of
every MoE layer's experts per rank, shards their optimizer states over the
dp / ep ranks that hold the same experts, counts the all-to-all buffers, and
the simulator runs two all-to-alls per MoE layer in F and B (hidden by the
braid, exposed in a pass on its own); the DP sync syncs the experts over dp /
ep (`stp.plan.expert_sync`). The EP group's peers inside a node (`--gpus-per-
node`) are reached over NVLink, the rest over the network
(`stp.costmodel.moe.a2a_time`): the hardware's `node_gpus` is the request's.

Both bounds the planner prunes by (`stp.plan.price`) stay bounds for a
mixture of experts, and get tighter here, since ep multiplies the
configurations (each term holds on every rank, so the rank that peaks holds
at least the bound plus the smallest term over ranks):

    memory  + the experts' masters and moments the sharded optimizer cannot
              split dp ways (only dp / ep: `memory_bound` divides them by
              dp) + the all-to-all's send and receive buffers of two passes
              (`stp.costmodel.memory`)
    time    for a schedule that never braids (every action one pass, so each
              F or B unit waits for its collectives, `stp.sim.engine`): m x
              the rank's layers x (each F's all-reduce and all-to-alls + half
              each B's all-to-alls: a full backward's last unit may hide its
              collective under its W units, and a stage has at least 2 units)

A dense model's configurations are priced and bounded exactly as before.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from stp.costmodel.decoder_costs import derive_decoder
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.memory import DTYPE_BYTES, rank_parameters
from stp.costmodel.model import ModelSpec
from stp.costmodel.moe import MoESpec
from stp.plan.price import (
    Priced,
    exact_memory_bound,
    memory_bound,
    price,
    spec_for,
    time_bound,
)
from stp.plan.request import PlanRequest
from stp.plan.space import BRAIDED, Config
from stp.schedule.registry import generate
from stp.sim.layered import even_partition

__all__ = ["model_at", "hardware_of", "priced", "bound_time", "bound_memory", "is_moe",
           "bound_exact"]


def is_moe(model: ModelSpec) -> bool:
    return isinstance(model, MoESpec)


def model_at(model: ModelSpec, ep: int) -> ModelSpec:
    """`model` with its experts over `ep` ranks (a dense model as it is)."""
    return replace(model, ep=ep) if isinstance(model, MoESpec) and model.ep != ep else model


def hardware_of(request: PlanRequest) -> HardwareSpec:
    """The request's hardware, its nodes `--gpus-per-node` GPUs wide for a mixture
    of experts (where the all-to-all leaves NVLink); a dense model's as given."""
    hw = request.hardware
    if is_moe(request.model) and hw.node_gpus != request.gpus_per_node:
        return replace(hw, node_gpus=request.gpus_per_node)
    return hw


def priced(request: PlanRequest, cfg: Config, partition: tuple[int, ...] | None = None
           ) -> Priced:
    """`stp.plan.price.price` of `cfg` at its mesh's ep."""
    return price(model_at(request.model, cfg.mesh.ep), hardware_of(request), cfg,
                 request.seq_len, partition)


def bound_exact(request: PlanRequest, cfg: Config) -> float | None:
    """`stp.plan.price.exact_memory_bound` of `cfg` at its mesh's ep (None: none)."""
    return exact_memory_bound(model_at(request.model, cfg.mesh.ep), hardware_of(request),
                              cfg, request.seq_len)


@lru_cache(maxsize=4096)
def _experts_per_rank(model: ModelSpec, schedule: str, pp: int, chunks: int | None
                      ) -> tuple[int, ...]:
    """Expert weights each pipeline rank holds under the even split (`model` cut)."""
    sch = generate(schedule, pp, 1, **({} if chunks is None else {"chunks": chunks}))
    counts = even_partition(model.layers, sch.num_stages)
    return tuple(rank_parameters(model, sch.num_stages, sch.stage_to_rank, counts,
                                 experts_only=True))


@lru_cache(maxsize=4096)
def _layers_per_rank(schedule: str, pp: int, layers: int, chunks: int | None) -> int:
    """The fewest layers a pipeline rank holds under the even split."""
    sch = generate(schedule, pp, 1, **({} if chunks is None else {"chunks": chunks}))
    counts = even_partition(layers, sch.num_stages)
    mine = [0] * pp
    for stage, rank in enumerate(sch.stage_to_rank):
        mine[rank] += counts[stage]
    return min(mine)


def bound_memory(request: PlanRequest, cfg: Config) -> float:
    """Bytes the fullest rank of `cfg` holds at least (module doc)."""
    model, hw = model_at(request.model, cfg.mesh.ep), hardware_of(request)
    bound = memory_bound(model, hw, cfg, request.seq_len)
    if not isinstance(model, MoESpec) or cfg.mesh.ep == 1:
        return bound
    f, dp, ep = cfg.features, cfg.mesh.dp, cfg.mesh.ep
    spec = spec_for(model, cfg, request.seq_len)
    width = DTYPE_BYTES[f.dtype]
    states = (4 if f.sixteen_bit else 0) + 2 * max(4, width)  # masters + moments a weight
    fewest = min(_experts_per_rank(spec, cfg.schedule, cfg.mesh.pp, cfg.chunks))
    unsplit = fewest * states * (ep / dp - 1 / dp) if f.shard_optimizer else 0.0
    a2a = 2 * 2 * spec.sequence * spec.micro_batch * spec.hidden * width * spec.top_k  # type: ignore[attr-defined]  # a mixture of experts' spec: only MoE models are bounded here
    return bound + unsplit + a2a


def bound_time(request: PlanRequest, cfg: Config) -> float:
    """Seconds a step of `cfg` takes at least (module doc)."""
    model, hw = model_at(request.model, cfg.mesh.ep), hardware_of(request)
    bound = time_bound(model, hw, cfg, request.seq_len)
    if not isinstance(model, MoESpec) or cfg.schedule in BRAIDED:
        return bound
    spec = spec_for(model, cfg, request.seq_len)
    pp = cfg.mesh.pp
    c = derive_decoder(spec, hw, pp).costs
    per_layer = (c.ar + c.a2a + c.a2a / 2) * pp / spec.layers
    fewest = _layers_per_rank(cfg.schedule, pp, spec.layers, cfg.chunks)
    return bound + cfg.microbatches * fewest * per_layer / 1e3
