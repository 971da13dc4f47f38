"""What one configuration costs: bounds before simulating, and the simulated price.

Bounds (no schedule generated, no simulation; `stp.plan.planner` prunes by
them before it simulates anything):

    time    >= max over ranks of: the first microbatch's forward through
               the layers of the stages before the rank's first stage (it
               cannot start earlier), then m x (F + B + W) of its own layers
               (one compute stream runs them one after another), with the
               even split; + the DP reduction of the smallest stage (a
               rank's last action is a gradient pass of one of its stages,
               whose reduction can only start after it), + with the sharded
               optimizer the parameter all-gather of the average rank. The
               sends, exposed collectives, the embedding and the output
               layer's work and any idle time only add to it.
    memory  >= max over ranks of its model states (weights, fp32 gradients,
               masters and AdamW moments, exactly as `stp.costmodel.memory`
               counts them) + one microbatch's activations of its layers:
               every rank holds a whole microbatch's activations between its
               last F and first B (`stp.search.min_memory_limit`); with
               offload, none are counted.

The price is exactly `stp memory`'s estimate of the same configuration
(`stp.costmodel.memory.estimate_run`: the simulated step and the bytes per
rank), plus the exposed part of the DP gradient sync, placed on the
simulated timeline as stp's runtime runs it (`train.grad_sync`): per rank,
each stage's ring all-reduce of its fp32 gradients over `dp` replicas on the
inter-node link (`pp_bandwidth`, `pp_latency`; with the sharded optimizer a
reduce-scatter) starts when the stage's last W (or full backward) ends, the
rank's reductions one after another (`stp.sim.dp_overlap`); what ends after
the rank's compute is exposed. With the sharded optimizer the all-gather of
the updated parameters (in the model's dtype) follows the optimizer step,
exposed. `overlap_grad_sync=False` prices the runtime's other mode: every
reduction after the pipeline drains. A stage's parameters are the rank's
(`estimate_run`'s count) in the shares `rank_parameters` gives its stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from stp.costmodel.decoder.costs import decoder_model_flops, derive_decoder
from stp.costmodel.decoder.memory import (
    memory_of_run,
    rank_parameters,
    simulate_run,
    states_bound,
)
from stp.costmodel.decoder.spec import ModelSpec, num_parameters
from stp.costmodel.hardware import (
    HardwareSpec,
    allgather_time,
    allreduce_time,
    reduce_scatter_time,
)
from stp.costmodel.memory import DTYPE_BYTES, Features, Layout, MemoryEstimate
from stp.plan.expert_sync import expert_parameters, group_seconds, rank_experts
from stp.plan.space import Config
from stp.schedule.ir import Schedule
from stp.schedule.registry import generate
from stp.sim.dp_overlap import dp_timeline
from stp.sim.layered import even_partition
from stp.sim.result import SimResult

__all__ = ["Priced", "spec_for", "time_bound", "memory_bound", "exact_memory_bound", "price",
           "dp_sync_seconds", "model_flops_per_sequence", "dp_sync_parts"]


@dataclass(frozen=True)
class Priced:
    """A simulated configuration: its step and its bytes."""

    config: Config
    estimate: MemoryEstimate
    result: SimResult
    dp_sync_s: float
    """What the DP gradient sync adds to the pipeline's step: its exposed part (the
    reductions that end after the compute, the sharded optimizer's all-gather)."""
    partition: tuple[int, ...] | None = None
    """Explicit layers per stage, or None (the even split)."""
    dp_sync_total_s: float = 0.0
    """The DP gradient sync's whole time on the rank with the most parameters, hidden
    or not (the reductions, one after another, and the all-gather)."""

    @property
    def pipeline_s(self) -> float:
        return self.result.makespan / 1e3

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.dp_sync_s

    @property
    def peak_bytes(self) -> float:
        return self.estimate.peak.total


def spec_for(model: ModelSpec, config: Config, seq_len: int) -> ModelSpec:
    """The model cut as `config` cuts it."""
    f = config.features
    return replace(model, tp=config.mesh.tp, sequence=seq_len,
                   micro_batch=config.microbatch_size, sequence_parallel=f.sequence_parallel,
                   recompute=f.recompute)


def dp_sync_seconds(parameters: float, dp: int, hardware: HardwareSpec) -> float:
    """Ring all-reduce of `parameters` fp32 gradients over `dp` replicas."""
    return allreduce_time(4.0 * parameters, dp, hardware.pp_bandwidth, hardware.pp_latency)


def _reduction_seconds(parameters: float, dp: int, hardware: HardwareSpec, sharded: bool, *,
                       experts: float = 0.0, ep: int = 1) -> float:
    """One DP gradient reduction of `parameters` fp32 gradients, `experts` of them
    expert weights (over dp / ep, stp.plan.expert_sync): ring all-reduces, or with
    the sharded optimizer reduce-scatters."""
    collective = reduce_scatter_time if sharded else allreduce_time
    return group_seconds(collective, 4.0, parameters, experts, dp, ep, hardware)


def _gather_seconds(parameters: float, dp: int, hardware: HardwareSpec, width: int, *,
                    experts: float = 0.0, ep: int = 1) -> float:
    """The sharded optimizer's all-gather of the updated parameters (`width` bytes)."""
    return group_seconds(allgather_time, width, parameters, experts, dp, ep, hardware)


def dp_sync_parts(res: SimResult, rank_params: list[float], stage_shares: list[float],
                  dp: int, hardware: HardwareSpec, *, sharded: bool, width: int,
                  overlap: bool = True, expert_params: list[float] | None = None,
                  ep: int = 1) -> tuple[float, float]:
    """(seconds the DP gradient sync adds to the simulated step, its whole time on the
    rank with the most parameters) (module doc). `rank_params`: parameters of each
    pipeline rank; `stage_shares`: each global stage's weight in its rank's count;
    `expert_params`: the expert weights among each rank's parameters (synced over
    dp / ep; None: a dense model), spread over its stages in the same shares."""
    owner = res.schedule.stage_to_rank
    ends, totals = [], []
    for stats in res.ranks:
        mine = [s for s, r in enumerate(owner) if r == stats.rank]
        weight = sum(stage_shares[s] for s in mine) or 1.0
        params = rank_params[stats.rank]
        experts = expert_params[stats.rank] if expert_params else 0.0
        times = {s: 1e3 * _reduction_seconds(params * stage_shares[s] / weight, dp, hardware,
                                              sharded, experts=experts * stage_shares[s] / weight,
                                              ep=ep) for s in mine}
        line = dp_timeline(stats.grads_final, times, stats.end, overlap=overlap)
        gather = 1e3 * _gather_seconds(params, dp, hardware, width, experts=experts, ep=ep) \
            if sharded else 0.0
        ends.append(line.end + gather)
        totals.append((rank_params[stats.rank], (line.total + gather) / 1e3))
    added = max(0.0, max(ends, default=0.0) - res.makespan) / 1e3
    return added, max(totals, default=(0.0, 0.0))[1]


def _shard_parameters(spec: ModelSpec) -> float:
    """Parameters of one TP rank's shard of the whole model (about 1/t; a mixture of
    experts' routed experts 1/ep of that again, stp.costmodel.moe)."""
    ep = spec.ep
    experts = spec.layers * spec.mlp_parameters()[1] * (1 - 1 / ep)
    return (num_parameters(spec) - experts) / spec.tp


@lru_cache(maxsize=4096)
def _placement(schedule: str, pp: int, layers: int,
               chunks: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(rank of each global stage, layers of each stage in the even split)."""
    sch = generate(schedule, pp, 1, **({} if chunks is None else {"chunks": chunks}))
    return sch.stage_to_rank, even_partition(layers, sch.num_stages)


def _rank_layers(config: Config, layers: int) -> list[tuple[int, int]]:
    """Per rank: (layers before its first stage, layers it holds), even split."""
    owner, counts = _placement(config.schedule, config.mesh.pp, layers, config.chunks)
    out = []
    for rank in range(config.mesh.pp):
        mine = [s for s, r in enumerate(owner) if r == rank]
        out.append((sum(counts[:min(mine)]), sum(counts[s] for s in mine)))
    return out


def time_bound(model: ModelSpec, hardware: HardwareSpec, config: Config, seq_len: int) -> float:
    """Seconds a step of `config` takes at least (module doc): per rank, the
    first microbatch's forward through the layers before its first stage,
    then its own F, B and W of every microbatch, one after another."""
    spec = spec_for(model, config, seq_len)
    pp = config.mesh.pp
    c = derive_decoder(spec, hardware, pp).costs
    per_layer = pp / spec.layers
    f, fbw = c.f * per_layer, (c.f + c.b + c.w) * per_layer
    busiest = max(before * f + config.microbatches * mine * fbw
                  for before, mine in _rank_layers(config, spec.layers))
    dp, sharded = config.mesh.dp, config.features.shard_optimizer
    ep = spec.ep
    shares = _stage_shares(spec, _placement(config.schedule, pp, spec.layers, config.chunks)[1])
    smallest = _shard_parameters(spec) * min(shares) / sum(shares)
    # a lower bound: the smallest stage's reduction, taken as all experts when the
    # model has any (experts reduce over dp / ep, the cheaper group)
    experts = smallest if expert_parameters(spec) > 0 else 0.0
    sync = _reduction_seconds(smallest, dp, hardware, sharded, experts=experts, ep=ep)
    if sharded:
        sync += _gather_seconds(_shard_parameters(spec) / pp, dp, hardware,
                                DTYPE_BYTES[config.features.dtype],
                                experts=expert_parameters(spec) / pp, ep=ep)
    return busiest / 1e3 + sync


def memory_bound(model: ModelSpec, hardware: HardwareSpec, config: Config,
                 seq_len: int) -> float:
    """Bytes the fullest rank of `config` holds at least (module doc): its
    model states and one microbatch's activations of its layers."""
    spec = spec_for(model, config, seq_len)
    f, dp, pp = config.features, config.mesh.dp, config.mesh.pp
    owner, counts = _placement(config.schedule, pp, spec.layers, config.chunks)
    params = rank_parameters(spec, len(counts), owner, counts)
    width = DTYPE_BYTES[f.dtype]
    shard = dp if f.shard_optimizer else 1
    grads = 4 if f.sixteen_bit else width
    masters = 4 / shard if f.sixteen_bit else 0.0
    moments = 2 * max(4, width) / shard
    per_layer = derive_decoder(spec, hardware, pp).bytes_per_unit * pp / spec.layers
    if f.offload != "none":
        per_layer = 0.0  # offloaded activations may leave before the next arrive
    return max(params[rank] * (width + grads + masters + moments)
               + mine * per_layer * width / 2
               for rank, (_, mine) in enumerate(_rank_layers(config, spec.layers)))


def price(model: ModelSpec, hardware: HardwareSpec, config: Config, seq_len: int,
          partition: tuple[int, ...] | None = None, *,
          overlap_grad_sync: bool = True) -> Priced:
    """Simulate `config` (module doc); ValueError when it cannot run."""
    mesh = config.mesh
    layout = Layout(pp=mesh.pp, tp=mesh.tp, dp=mesh.dp, microbatches=config.microbatches,
                    microbatch_size=config.microbatch_size, seq_len=seq_len,
                    schedule=config.schedule, partition=partition, chunks=config.chunks)
    est, res = _estimate(model, hardware, layout, config.features)
    counts = partition or even_partition(model.layers, res.schedule.num_stages)
    spec = spec_for(model, config, seq_len)
    ep, experts = rank_experts(spec, est, res)  # experts sync over dp / ep (expert_sync)
    added, total = dp_sync_parts(
        res, [r.parameters for r in est.ranks], _stage_shares(spec, counts),
        mesh.dp, hardware, sharded=config.features.shard_optimizer,
        width=DTYPE_BYTES[config.features.dtype], overlap=overlap_grad_sync,
        expert_params=experts, ep=ep)
    return Priced(config, est, res, added, partition, total)


def exact_memory_bound(model: ModelSpec, hardware: HardwareSpec, config: Config,
                       seq_len: int) -> float | None:
    """Bytes the fullest rank of `config` holds at least, found without
    simulating and nearly exact: `stp.costmodel.decoder.memory.states_bound` (the
    estimate's states, buffers and program-order activation peak; only the
    gradient copies over the peak are left out). None with offload."""
    mesh = config.mesh
    layout = Layout(pp=mesh.pp, tp=mesh.tp, dp=mesh.dp, microbatches=config.microbatches,
                    microbatch_size=config.microbatch_size, seq_len=seq_len,
                    schedule=config.schedule, chunks=config.chunks)
    totals = states_bound(model, hardware, layout, config.features,
                          _schedule(config.schedule, mesh.pp, config.microbatches,
                                    config.chunks))
    return None if totals is None else max(totals)


def _estimate(model: ModelSpec, hardware: HardwareSpec, layout: Layout,
              features: Features) -> tuple[MemoryEstimate, SimResult]:
    """`stp.costmodel.memory.estimate_run`, its simulation shared by the lever
    rungs and meshes that only change model states (`_simulated`)."""
    spec, res, unit, note = _simulated(model, hardware, layout,
                                       replace(features, shard_optimizer=False))
    est = memory_of_run(spec, res, unit * 2 / DTYPE_BYTES[features.dtype], features,
                        dp=layout.dp)
    if spec.has_experts:
        est = replace(est, layout=replace(est.layout, ep=spec.ep))
    return (replace(est, notes=(*est.notes, note)) if note else est), res


@lru_cache(maxsize=256)
def _simulated(model: ModelSpec, hardware: HardwareSpec, layout: Layout,
               features: Features) -> tuple[ModelSpec, SimResult, float, str | None]:
    """One simulation per (model, hardware, layout, features) that reach the
    simulator: the planner retries an over-budget configuration at its next
    lever rung, and the sharded optimizer (the ladder's first lever) changes
    model states only, so that retry needs no new simulation:
    `features.shard_optimizer` is set aside by the caller for that reason (dp
    is kept: it decides a mixture of experts' ep, `stp.costmodel.memory`)."""
    return simulate_run(model, hardware, layout, features,
                        _schedule(layout.schedule, layout.pp, layout.microbatches,
                                  layout.chunks))


@lru_cache(maxsize=512)
def _schedule(name: str, pp: int, m: int, chunks: int | None) -> Schedule:
    """A generated schedule (immutable), shared by every pricing of it."""
    return generate(name, pp, m, **({} if chunks is None else {"chunks": chunks}))


def _stage_shares(spec: ModelSpec, counts: tuple[int, ...]) -> list[float]:
    """Each stage's parameters (its layers; the embedding on the first, the output
    layer on the last), as weights of its rank's count."""
    return [float(x) for x in rank_parameters(spec, len(counts), tuple(range(len(counts))),
                                              counts)]


def model_flops_per_sequence(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs of one sequence (F, B and W of every layer and the output
    layer, no recomputation, unsharded): the numerator of MFU (Chowdhery et
    al., PaLM, arXiv 2204.02311, appendix B: recomputed work is not counted)."""
    return decoder_model_flops(replace(model, sequence=seq_len, micro_batch=1))
