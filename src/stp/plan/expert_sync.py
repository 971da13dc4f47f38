"""The DP gradient sync of a mixture of experts: dense weights over dp, experts over dp / ep.

stp's runtime carves the expert-parallel group from the data-parallel ranks
(Megatron-LM's arrangement, docs/architecture.md "Expert parallelism"): ep
consecutive DP ranks hold different experts, and the dp / ep ranks that hold
the same experts form the expert-data-parallel (EDP) group. `GradSync`
all-reduces the dense gradients over dp and the experts' over the EDP group
(`train.grad_sync`), one after the other on the inter-node link, so a rank
with `P` parameters of which `P_e` are expert weights syncs in

    T = AR(4 (P - P_e) bytes over dp) + AR(4 P_e bytes over dp / ep)

(fp32 gradients, ring all-reduce `stp.costmodel.hardware.allreduce_time`).
At ep = dp the experts need no sync at all. A dense model (P_e = 0) syncs in
AR(4 P over dp), `stp.plan.price.dp_sync_seconds`, to the bit.
"""

from __future__ import annotations

from dataclasses import replace

from stp.costmodel.hardware import HardwareSpec, allreduce_time
from stp.costmodel.memory import MemoryEstimate, rank_parameters
from stp.costmodel.model import ModelSpec
from stp.costmodel.moe import MoESpec
from stp.sim.result import SimResult

__all__ = ["expert_parameters", "grad_sync_seconds", "slowest_grad_sync"]


def _ep(spec: ModelSpec) -> int:
    return spec.ep if isinstance(spec, MoESpec) else 1


def expert_parameters(spec: ModelSpec) -> float:
    """Expert weights of one TP rank's share of the whole model at its ep: every
    MoE layer's experts over t x ep ranks (0 for a dense model)."""
    return spec.layers * spec.mlp_parameters()[1] / (spec.tp * _ep(spec))


def grad_sync_seconds(spec: ModelSpec, parameters: float, experts: float, dp: int,
                      hardware: HardwareSpec) -> float:
    """Seconds to sync `parameters` gradients, `experts` of them expert weights
    (module doc): the dense rest over dp, the experts over dp / ep."""
    bw, lat = hardware.pp_bandwidth, hardware.pp_latency
    dense = allreduce_time(4.0 * (parameters - experts), dp, bw, lat)
    if experts <= 0:
        return dense
    return dense + allreduce_time(4.0 * experts, dp // _ep(spec), bw, lat)


def slowest_grad_sync(spec: ModelSpec, est: MemoryEstimate, res: SimResult,
                      hardware: HardwareSpec) -> float:
    """The sync of the rank that takes longest (module doc); `spec` cut as the run
    was (tp, ep), `est` and `res` its estimate and simulated step."""
    dp = est.layout.dp
    if isinstance(spec, MoESpec) and est.layout.ep not in (None, spec.ep):
        spec = replace(spec, ep=est.layout.ep)  # the ep the estimate priced (memory.Layout.ep)
    if _ep(spec) == 1:  # one group for every weight: the rank with the most parameters
        return grad_sync_seconds(spec, max(r.parameters for r in est.ranks), 0.0, dp, hardware)
    sch = res.schedule
    counts = tuple(est.layout.partition or ())
    experts = rank_parameters(spec, sch.num_stages, sch.stage_to_rank, counts,
                              experts_only=True)
    return max(grad_sync_seconds(spec, r.parameters, experts[r.rank], dp, hardware)
               for r in est.ranks)
