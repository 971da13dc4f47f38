"""`search`: the fastest schedule whose every rank stays within a memory limit.

Method (each step judged by the simulator, `stp.sim.simulate`, or by the
fast replay of `stp.search.replay` where that is the simulator's):

1. Seeds: every handcrafted schedule of the registry that fits the limit and
   the requested space (placement, braiding). The answer is never slower than
   the best of them, by construction.
2. Construction: the greedy list scheduler (`stp.search.greedy`, after the
   Zero Bubble heuristic, "Zero Bubble Pipeline Parallelism", arXiv
   2401.10241, section 3.1) over a grid of policies (`stp.search.space`), for
   each placement (one chunk per rank and V), each without and with
   in-flight caps from the critical-path warm-up estimate (`warmup_caps`,
   ZB-H2's `2(p-s)-1` generalised). With ar > 0 and braiding allowed the
   grid includes STP-style braided policies.
3. V constructions (V placement, run before step 2 so a short time limit
   still gets them): ZB-V built from the costs (`stp.search.zbv`)
   and the adaptive scheme of "Pipeline Parallelism with Controllable
   Memory" (arXiv 2405.15362): every V-shape building block whose peak fits
   the limit, squeezed and reordered, the most promising first
   (`stp.search.vshape`).
4. Improvement: (ar > 0) braiding adjacent passes of the best orders into
   blocks and coordinate descent on the per-rank caps of the best greedy
   candidates (`stp.search.local`); then a local search (`stp.search.moves`)
   from the best candidate of each construction: single moves of actions on
   the critical chains, kept when the simulated score improves.

The search stops early only when every step is done: each local search has
reached a schedule that no move of its neighbourhood improves (a move off
the critical chains cannot shorten them; see `stp.search.moves`). Otherwise
each step stops at its share of `time_limit` (`stp.search.steps.SHARES`;
what a step leaves goes to the next, the local search last), less a reserve
for the final validation and simulation (`Run.reserve`: at least 10% of the
limit, more on a slow or loaded machine); `SearchResult.converged` says
which.

An exact model (the Zero Bubble paper's ILP, Appendix G) is left out: it
needs a solver the project does not depend on, and at p = 32, m = 96 it has
~10^8 ordering variables; the greedy with caps already reproduces the
paper's searched bubble rates (see benchmarks/bench_search.py).

Scores: `makespan` (default) ranks by the simulated step time, then by the
longest rank span; `span` ranks by the longest rank span first, the Zero
Bubble paper's cost, which orders schedules as its bubble rate does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from stp.schedule.ir import Block, Schedule
from stp.schedule.memory import MemCosts
from stp.schedule.registry import SCHEDULES
from stp.search.space import placement
from stp.search.steps import Run
from stp.sim.costs import Costs
from stp.sim.engine import simulate
from stp.sim.result import SimResult
from stp.sim.stages import StageCostsFor

__all__ = ["Baseline", "SearchResult", "search", "min_memory_limit", "OBJECTIVES"]

OBJECTIVES = ("makespan", "span")
_PLACEMENTS = ("looped", "v", "auto")
_BRAIDED = ("auto", "on", "off")
_EPS = 1e-9


@dataclass
class Baseline:
    """A handcrafted schedule under the same costs and limit."""

    name: str
    result: SimResult | None
    note: str = ""
    """Why it is not comparable (over the limit, too few microbatches), or ''."""


@dataclass
class SearchResult:
    schedule: Schedule
    result: SimResult
    origin: str
    """Where the winner came from: a greedy policy, a refinement, a handcrafted seed."""
    seconds: float
    evaluated: int
    """Candidate schedules scored."""
    memory_limit: float
    objective: str
    baselines: list[Baseline] = field(default_factory=list)
    converged: bool = False
    """True when the search stopped because no step had anything left to try
    (every local search at a local optimum), False when time ran out."""

    def to_json(self) -> dict[str, object]:
        """`stp simulate --json` fields of the found schedule, plus the search's own."""
        out = self.result.to_json()
        out.update(
            search_seconds=self.seconds,
            origin=self.origin,
            evaluated=self.evaluated,
            memory_limit=self.memory_limit,
            objective=self.objective,
            converged=self.converged,
            baselines=[
                {
                    "schedule": b.name,
                    "makespan": b.result.makespan if b.result else None,
                    "bubble_rate": b.result.bubble_rate if b.result else None,
                    "peak_activation": max(b.result.peak_activation) if b.result else None,
                    "note": b.note,
                }
                for b in self.baselines
            ],
        )
        return out


def min_memory_limit(mem: MemCosts) -> float:
    """The smallest limit any schedule meets: M_B. Every forward of a microbatch
    on a rank runs before any of its backwards there (the loss is computed after
    the last stage), so all of a microbatch's activations on a rank are alive at
    once; running one microbatch at a time reaches exactly M_B."""
    return mem.m_b


def _check(p: int, m: int, limit: float, placement_kind: str, braided: str, objective: str,
           chunks: int, time_limit: float, mem: MemCosts) -> None:
    for what, val in (("pp", p), ("microbatches", m), ("chunks", chunks)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"search: {what}={val!r} must be an integer >= 1")
    if placement_kind not in _PLACEMENTS:
        raise ValueError(
            f"placement {placement_kind!r} unknown; accepted: {', '.join(_PLACEMENTS)}"
        )
    if braided not in _BRAIDED:
        raise ValueError(f"braided {braided!r} unknown; accepted: {', '.join(_BRAIDED)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} unknown; accepted: {', '.join(OBJECTIVES)}")
    if not time_limit > 0:
        raise ValueError(f"time limit {time_limit!r} must be > 0 seconds")
    need = min_memory_limit(mem)
    if not limit >= need - _EPS:
        raise ValueError(
            f"memory limit {limit:g} is below what any schedule can meet; the minimum "
            f"feasible limit is {need:g} (M_B: a microbatch's activations through a "
            "rank's share are all alive between its last forward and first backward there)"
        )


def _baselines(p: int, m: int, costs: Costs, mem: MemCosts, limit: float, layers: int,
               stage_costs: StageCostsFor | None = None) -> list[tuple[Baseline, Schedule | None]]:
    out: list[tuple[Baseline, Schedule | None]] = []
    for name, spec in SCHEDULES.items():
        if p < spec.min_ranks:
            out.append((Baseline(name, None, f"needs pp >= {spec.min_ranks}"), None))
            continue
        sch = spec.load()(p, m)
        try:
            stages = None if stage_costs is None else stage_costs(sch.num_stages)
        except ValueError:  # a fixed table of another stage count
            out.append((Baseline(name, None, f"{sch.num_stages} stages: no stage costs"), None))
            continue
        res = simulate(sch, costs, mem, layers, record_spans=False, stages=stages)
        peak = max(res.peak_activation)
        note = "" if peak <= limit + _EPS else f"peak {peak:g} > limit {limit:g}"
        out.append((Baseline(name, res, note), sch))
    return out


def _in_space(sch: Schedule, kind: str, kinds: list[tuple[str, int]], braid: bool) -> bool:
    """Whether a handcrafted schedule may seed the search (`auto`: any placement)."""
    if not braid and any(isinstance(a, Block) for acts in sch.actions for a in acts):
        return False
    if kind == "auto":
        return True
    return any(sch.stage_to_rank == placement(k, sch.num_ranks, v) for k, v in kinds)


def search(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | None = None,
    mem: MemCosts | None = None,
    *,
    memory_limit: float,
    placement_kind: str = "auto",
    braided: str = "auto",
    chunks: int = 1,
    objective: str = "makespan",
    time_limit: float = 20.0,
    layers: int = 1,
    stage_costs: StageCostsFor | None = None,
) -> SearchResult:
    """Search per-rank orders minimising `objective` with every rank's peak
    activation <= `memory_limit` (units of M_B, as the simulator reports).

    `placement_kind`: `looped` (v = `chunks`, 1 for a plain pipeline), `v` (two
    chunks in a V) or `auto` (both). `braided`: `on` lets the search form STP
    braided blocks, `off` forbids them, `auto` is `on` when costs.tp_time > 0.
    Raises ValueError for a limit below `min_memory_limit(mem)`, naming it.

    `stage_costs(num_stages)` (optional) gives the per-stage cost table
    (`stp.sim.stages`) of a schedule with that many global stages, or raises
    ValueError when it has none; candidates are then timed with it and kept
    only when their per-stage peak fits the limit. `costs` and `mem` (the
    average rank share) still guide the constructions.
    """
    costs = costs or Costs()
    mem = mem or MemCosts()
    p, m = num_ranks, num_microbatches
    _check(p, m, memory_limit, placement_kind, braided, objective, chunks, time_limit, mem)
    t0 = time.perf_counter()
    kinds = {"looped": [("looped", chunks)], "v": [("v", 2)]}.get(
        placement_kind, [("looped", chunks), ("v", 2)]
    )
    run = Run(
        p, m, costs, mem, memory_limit, objective, layers,
        braid=braided == "on" or (braided == "auto" and costs.tp_time > 0),
        kinds=kinds, started=t0, time_limit=time_limit, stage_costs=stage_costs,
    )
    baselines = _baselines(p, m, costs, mem, memory_limit, layers, stage_costs)
    # Nine generations and simulations: several times the final validation and
    # simulation, on this machine under its present load.
    run.steps_from = time.perf_counter()
    run.reserve = max(0.1 * time_limit, 0.5 * (run.steps_from - t0))
    run.seed([(b.name, sch, b.result) for b, sch in baselines
              if sch is not None and b.result is not None and not b.note
              and _in_space(sch, placement_kind, kinds, run.braid)])
    run.v_constructions()
    best_by_kind = run.greedy_grid()
    if run.braid and costs.tp_time > 0:
        run.braid_best()
    run.refine_caps(best_by_kind)
    run.local_search()
    best, origin = run.winner()
    return SearchResult(
        schedule=best,
        result=run.simulate(best),
        origin=origin,
        seconds=time.perf_counter() - t0,
        evaluated=run.evaluated,
        memory_limit=memory_limit,
        objective=objective,
        baselines=[b for b, _ in baselines],
        converged=run.converged,
    )
