"""The DP gradient sync of a mixture of experts: dense weights over dp, experts over dp / ep.

stp's runtime carves the expert-parallel group from the data-parallel ranks
(Megatron-LM's arrangement, docs/architecture.md "Expert parallelism"): ep
consecutive DP ranks hold different experts, and the dp / ep ranks that hold
the same experts form the expert-data-parallel (EDP) group. `GradSync`
all-reduces the dense gradients over dp and the experts' over the EDP group
(`train.grad_sync`), one after the other on the inter-node link, so a stage
with `P` parameters of which `P_e` are expert weights reduces in

    T = C(4 (P - P_e) bytes over dp) + C(4 P_e bytes over dp / ep)

(fp32 gradients; C a ring all-reduce, or with the sharded optimizer a
reduce-scatter, and the all-gather of the updated weights likewise in their
dtype: `stp.costmodel.hardware`). At ep = dp the experts need no sync at all.
A dense model (P_e = 0) reduces over dp alone. `stp.plan.price` places each
stage's reduction on the simulated timeline (`stp.sim.dp_overlap`).
"""

from __future__ import annotations

from collections.abc import Callable

from stp.costmodel.decoder.memory import rank_parameters
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.memory import MemoryEstimate
from stp.sim.result import SimResult

__all__ = ["expert_parameters", "group_seconds", "rank_experts"]


def expert_parameters(spec: ModelSpec) -> float:
    """Expert weights of one TP rank's share of the whole model at its ep: every
    MoE layer's experts over t x ep ranks (0 for a dense model)."""
    return spec.layers * spec.mlp_parameters()[1] / (spec.tp * spec.ep)


def group_seconds(collective: Callable[[float, int, float, float], float], width: float,
                  parameters: float, experts: float, dp: int, ep: int,
                  hardware: HardwareSpec) -> float:
    """`collective` (stp.costmodel.hardware: allreduce_time, reduce_scatter_time,
    allgather_time) of `width` bytes a parameter for `parameters` weights, `experts`
    of them expert weights (module doc): the dense rest over dp, the experts over
    dp / ep, one after the other on the inter-node link."""
    bw, lat = hardware.pp_bandwidth, hardware.pp_latency
    dense = collective(width * (parameters - experts), dp, bw, lat)
    if experts <= 0:
        return dense
    return dense + collective(width * experts, dp // ep, bw, lat)


def rank_experts(spec: ModelSpec, est: MemoryEstimate, res: SimResult) -> tuple[int, list[float]]:
    """(the ep the estimate priced, the expert weights among each pipeline rank's
    parameters; all 0 for a dense model or at ep 1, where every weight syncs over dp)."""
    if est.layout.ep not in (None, spec.ep):
        spec = spec.with_ep(est.layout.ep)  # the ep the estimate priced (memory.Layout.ep)
    ep = spec.ep
    if ep == 1:
        return 1, [0.0] * len(est.ranks)
    sch = res.schedule
    counts = tuple(est.layout.partition or ())
    experts = rank_parameters(spec, sch.num_stages, sch.stage_to_rank, counts, experts_only=True)
    return ep, [float(experts[r.rank]) for r in est.ranks]
