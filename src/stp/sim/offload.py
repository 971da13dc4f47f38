"""Offload policies turned into plans, with the timing the selective one needs.

Policies (`--offload`):
  none          nothing leaves the device.
  stp           the offload variant of "Synergistic Tensor and Pipeline
                Parallelism" (arXiv 2510.27257):
                chunk-0 activations go out right after their forward and
                come back one block before their backward; chunk 1, whose
                backward follows soon after its forward in a V schedule,
                stays resident.
  all           every forward's activations, reloaded one block ahead.
  selective:X   selective offload of "PipeOffload" (arXiv 2503.01328): offload the
                longest-lived activations first until the peak is cut by
                about the fraction X, skipping those whose lifetime (end of
                F to start of B, measured without offload) is shorter than
                about three round trips of the copy, which would only stall.
"""

from __future__ import annotations

from stp.schedule.ir import Schedule
from stp.schedule.memory import MemCosts
from stp.schedule.offload import STP_CHUNK, OffloadPlan, parse_policy, plan_chunks, positions
from stp.sim.costs import Costs, OffloadCosts
from stp.sim.stages import StageCosts

__all__ = ["plan_offload", "offload_ratio"]


def plan_offload(
    schedule: Schedule,
    policy: str | None,
    costs: Costs,
    mem: MemCosts,
    offload_costs: OffloadCosts,
    layers: int = 1,
    stages: StageCosts | None = None,
) -> OffloadPlan:
    """The plan of `policy`; `stages`: time the selective policy with this
    per-stage cost table (`stp.sim.stages`)."""
    name, frac = parse_policy(policy)
    if name == "none":
        return OffloadPlan({}, "none")
    if name == "stp":
        return plan_chunks(schedule, {STP_CHUNK}, policy="stp")
    if name == "all":
        return plan_chunks(schedule, None, policy="all")
    assert frac is not None
    return _selective(schedule, frac, costs, mem, offload_costs, layers, stages)


def _selective(
    schedule: Schedule,
    frac: float,
    costs: Costs,
    mem: MemCosts,
    oc: OffloadCosts,
    layers: int,
    stages: StageCosts | None = None,
) -> OffloadPlan:
    from stp.sim.engine import simulate  # local: engine imports this package's peers

    base = simulate(schedule, costs, mem, layers, record_spans=True, stages=stages)
    target = max(base.peak_activation) * (1 - frac)
    f_end: dict[tuple[int, int], float] = {}
    b_start: dict[tuple[int, int], float] = {}
    for sp in base.spans:
        if sp.lane != "compute":
            continue
        key = (sp.stage, sp.mb)
        if sp.kind == "F":
            f_end[key] = max(f_end.get(key, 0.0), sp.end)
        elif sp.kind == "B":
            b_start[key] = min(b_start.get(key, float("inf")), sp.start)
    round_trip = 2 * oc.copy_time(mem.m_b / schedule.chunks)
    every = plan_chunks(schedule, None, policy="selective").reload_at
    pos = positions(schedule)
    candidates = sorted(
        (
            (b_start[k] - f_end[k], k)
            for k in every
            if k in f_end and k in b_start and b_start[k] - f_end[k] >= 3 * round_trip
        ),
        key=lambda c: (-c[0], pos[c[1]][0], c[1]),
    )
    policy = f"selective:{frac:g}"

    def peak_with(n: int) -> float:
        plan = OffloadPlan({k: every[k] for _, k in candidates[:n]}, policy)
        res = simulate(schedule, costs, mem, layers, offload=plan, offload_costs=oc,
                       record_spans=False, stages=stages)
        return max(res.peak_activation)

    # the peak falls (weakly) as more long-lived activations leave: bisect the
    # smallest prefix of the longest-lived candidates that meets the target,
    # or, when no prefix can, the best peak reachable
    lo, hi = 0, len(candidates)
    target = max(target, peak_with(hi))
    while lo < hi:
        mid = (lo + hi) // 2
        if peak_with(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return OffloadPlan({k: every[k] for _, k in candidates[:lo]}, policy)


def offload_ratio(costs: Costs, mem: MemCosts, oc: OffloadCosts) -> float:
    """PipeOffload's offload cost ratio k = T_offload / T_compute ("PipeOffload",
    arXiv 2503.01328): the time to copy one microbatch's activations out, over
    the compute they cost. With k <= 1 every activation can be offloaded
    without slowing the step."""
    compute = costs.f + costs.b + costs.w
    return oc.copy_time(mem.m_b) / compute if compute > 0 else float("inf")
