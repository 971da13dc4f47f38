"""What the simulator looks up per global stage: unit times, all-reduce
(and all-to-all) times, unit counts, memory changes and offload copy times.

Built once per run from the uniform `Costs` shorthand or a `StageCosts`
table. The uniform path computes every figure with the same expressions as
before per-stage costs existed (`costs.f / v / units`, `pass_memory_delta`),
so uniform results are the same bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from stp.schedule.ir import Kind, Pass, Schedule, passes_of
from stp.schedule.memory import MemCosts, pass_memory_delta
from stp.sim.costs import Costs, OffloadCosts
from stp.sim.stages import StageCosts
from stp.sim.units import UnitKind

__all__ = ["StageTable", "program_peaks", "stage_table"]


@dataclass(frozen=True)
class StageTable:
    """Per global stage (lists indexed by stage)."""

    unit_time: list[dict[UnitKind, float]]
    """Time of one F, B or W unit."""
    ar_time: list[dict[UnitKind, float]]
    """All-reduce after one F or B unit."""
    ag_time: list[dict[UnitKind, float]]
    """Sequence parallelism: all-gather before one F or B unit."""
    rs_time: list[dict[UnitKind, float]]
    """Sequence parallelism: reduce-scatter after one F or B unit."""
    a2a_time: list[dict[UnitKind, float]]
    """Expert parallelism: all-to-all after one F or B unit (after its TP collective)."""
    units: list[int]
    """Units of one pass."""
    delta: list[dict[Kind, float]]
    """Signed change of resident activations a pass of each kind makes."""
    chunk_act: list[float]
    """Activations of one microbatch in the stage (what one offload moves)."""
    copy_time: list[float]
    """One-way host copy of `chunk_act`."""


def _uniform(num_stages: int, chunks: int, costs: Costs, mem: MemCosts, layers: int,
             oc: OffloadCosts) -> StageTable:
    v, n = chunks, 2 * layers
    unit = {UnitKind.F: costs.f / v / n, UnitKind.B: costs.b / v / n, UnitKind.W: costs.w / v / n}
    ar = costs.ar / v / n
    ars = {UnitKind.F: ar, UnitKind.B: ar, UnitKind.W: 0.0}
    ags = _f_and_b(costs.ag / v / n)
    rss = _f_and_b(costs.rs / v / n)
    a2as = _f_and_b(costs.a2a / v / n)
    delta = {k: pass_memory_delta(Pass(0, k, 0), v, mem) for k in Kind}
    act = mem.m_b / v
    return StageTable([unit] * num_stages, [ars] * num_stages, [ags] * num_stages,
                      [rss] * num_stages, [a2as] * num_stages, [n] * num_stages,
                      [delta] * num_stages, [act] * num_stages,
                      [oc.copy_time(act)] * num_stages)


def _f_and_b(per_unit: float) -> dict[UnitKind, float]:
    """A collective of F and B units (its dual in the backward moves the same
    bytes: an all-gather's is a reduce-scatter and the reverse); W has none."""
    return {UnitKind.F: per_unit, UnitKind.B: per_unit, UnitKind.W: 0.0}


def _per_stage(stages: StageCosts, oc: OffloadCosts) -> StageTable:
    units, times, ars, ags, rss, a2as, deltas, acts = [], [], [], [], [], [], [], []
    for st in stages.stages:
        n = st.units
        units.append(n)
        times.append({UnitKind.F: st.f / n, UnitKind.B: st.b / n, UnitKind.W: st.w / n})
        ars.append({UnitKind.F: st.ar / n, UnitKind.B: st.ar_backward / n, UnitKind.W: 0.0})
        ags.append(_f_and_b(st.ag / n))
        rss.append(_f_and_b(st.rs / n))
        a2as.append(_f_and_b(st.a2a / n))
        deltas.append({Kind.F: st.mem_b, Kind.B: -(st.mem_b - st.mem_w), Kind.W: -st.mem_w,
                       Kind.BW: -st.mem_b})
        acts.append(st.mem_b)
    return StageTable(times, ars, ags, rss, a2as, units, deltas, acts,
                      [oc.copy_time(a) for a in acts])


def stage_table(num_stages: int, chunks: int, costs: Costs, mem: MemCosts, layers: int,
                stages: StageCosts | None, oc: OffloadCosts) -> StageTable:
    """The lookups of a run: from `stages` when given (it must have
    `num_stages` entries), else from the uniform `costs`, `mem`, `layers`."""
    if stages is None:
        return _uniform(num_stages, chunks, costs, mem, layers, oc)
    stages.check_fits(num_stages)
    return _per_stage(stages, oc)


def program_peaks(schedule: Schedule, stages: StageCosts) -> list[float]:
    """Each rank's peak of resident activations, walking its actions in program
    order: an action allocates its forwards' activations when it starts and
    releases its backwards' when it ends, and a rank's compute lane runs its
    actions one after another, so without offload this is the peak `simulate`
    reports (`stp.sim.rank_lanes.memory_curves`), found without timing anything
    (the planner's memory bound, `stp.plan.price`)."""
    delta = _per_stage(stages, OffloadCosts()).delta
    peaks = []
    for actions in schedule.actions:
        cur = peak = 0.0
        for action in actions:
            alloc = free = 0.0
            for p in passes_of(action):
                d = delta[p.stage][p.kind]
                if d > 0:
                    alloc += d
                else:
                    free -= d
            peak = max(peak, cur + alloc)
            cur += alloc - free
        peaks.append(peak)
    return peaks
