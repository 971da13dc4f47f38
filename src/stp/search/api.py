"""`search`: the fastest schedule whose every rank stays within a memory limit.

Method (each step judged by the simulator, `stp.sim.simulate`):

1. Seeds: every handcrafted schedule of the registry that fits the limit and
   the requested space (placement, braiding). The answer is never slower than
   the best of them, by construction.
2. Construction: the greedy list scheduler (`stp.search.greedy`, after the
   Zero Bubble heuristic, Qi et al. ICLR 2024, section 3.1) over a grid of
   policies (`stp.search.space`), for each placement (one chunk per rank and
   V), each without and with in-flight caps from the critical-path warm-up
   estimate (`greedy.warmup_caps`, ZB-H2's `2(p-s)-1` generalised). With
   ar > 0 and braiding allowed the grid includes STP-style braided policies.
3. Improvement: coordinate descent on the per-rank caps of the best greedy
   candidates, then (ar > 0) braiding adjacent passes of the best orders
   into blocks (`stp.search.local`).

An exact model (the paper's ILP, Appendix G) is left out: it needs a solver
the project does not depend on, and at p = 32, m = 96 it has ~10^8 ordering
variables; the greedy with caps already reproduces the paper's searched
bubble rates (see benchmarks/bench_search.py).

Scores: `makespan` (default) ranks by the simulated step time, then by the
longest rank span; `span` ranks by the longest rank span first, the Zero
Bubble paper's cost, which orders schedules as its bubble rate does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from stp.schedule.ir import Block, Schedule
from stp.schedule.memory import MemCosts, peak_by_order
from stp.schedule.registry import SCHEDULES
from stp.schedule.validate import validate
from stp.search.greedy import build, warmup_caps
from stp.search.local import braid_pass, refine_caps
from stp.search.space import Policy, placement, policies
from stp.sim.costs import Costs
from stp.sim.engine import simulate
from stp.sim.result import SimResult

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

    def to_json(self) -> dict[str, object]:
        """`stp simulate --json` fields of the found schedule, plus the search's own."""
        out = self.result.to_json()
        out.update(
            search_seconds=self.seconds,
            origin=self.origin,
            evaluated=self.evaluated,
            memory_limit=self.memory_limit,
            objective=self.objective,
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


@dataclass
class _Candidate:
    score: tuple[float, float]
    origin: str
    schedule: Schedule


def min_memory_limit(mem: MemCosts) -> float:
    """The smallest limit any schedule meets: M_B. Every forward of a microbatch
    on a rank runs before any of its backwards there (the loss is computed after
    the last stage), so all of a microbatch's activations on a rank are alive at
    once; running one microbatch at a time reaches exactly M_B."""
    return mem.m_b


def _score(makespan: float, span: float, objective: str) -> tuple[float, float]:
    return (makespan, span) if objective == "makespan" else (span, makespan)


def _sim_score(res: SimResult, objective: str) -> tuple[float, float]:
    return _score(res.makespan, res.critical_rank.span, objective)


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


def _baselines(p: int, m: int, costs: Costs, mem: MemCosts, limit: float,
               layers: int) -> list[tuple[Baseline, Schedule | None]]:
    out: list[tuple[Baseline, Schedule | None]] = []
    for name, spec in SCHEDULES.items():
        need = spec.min_microbatches(p)
        if m < need:
            out.append((Baseline(name, None, f"needs m >= {need}"), None))
            continue
        sch = spec.load()(p, m)
        res = simulate(sch, costs, mem, layers, record_spans=False)
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
) -> SearchResult:
    """Search per-rank orders minimising `objective` with every rank's peak
    activation <= `memory_limit` (units of M_B, as the simulator reports).

    `placement_kind`: `looped` (v = `chunks`, 1 for a plain pipeline), `v` (two
    chunks in a V) or `auto` (both). `braided`: `on` lets the search form STP
    braided blocks, `off` forbids them, `auto` is `on` when costs.ar > 0.
    Raises ValueError for a limit below `min_memory_limit(mem)`, naming it.
    """
    costs = costs or Costs()
    mem = mem or MemCosts()
    p, m = num_ranks, num_microbatches
    _check(p, m, memory_limit, placement_kind, braided, objective, chunks, time_limit, mem)
    t0 = time.perf_counter()
    deadline = t0 + 0.9 * time_limit  # the rest for the final validation and simulation
    braid = braided == "on" or (braided == "auto" and costs.ar > 0)
    kinds = {"looped": [("looped", chunks)], "v": [("v", 2)]}.get(
        placement_kind, [("looped", chunks), ("v", 2)]
    )
    evaluated = 0
    pool: list[_Candidate] = []

    def out_of_time() -> bool:
        return time.perf_counter() > deadline

    def evaluate(pl: tuple[int, ...], pol: Policy) -> _Candidate | None:
        nonlocal evaluated
        built = build(pl, m, costs, mem, memory_limit, pol)
        if built is None:
            return None
        evaluated += 1
        if built.exact and layers == 1:  # the greedy's timeline is the simulator's
            score = _score(built.makespan, built.max_span, objective)
        else:
            res = simulate(built.schedule, costs, mem, layers, record_spans=False)
            score = _sim_score(res, objective)
        return _Candidate(score, pol.label(), built.schedule)

    # 1. handcrafted seeds
    baselines = _baselines(p, m, costs, mem, memory_limit, layers)
    for base, sch in baselines:
        if sch is not None and not base.note and _in_space(sch, placement_kind, kinds, braid):
            assert base.result is not None
            pool.append(_Candidate(_sim_score(base.result, objective),
                                   f"handcrafted {base.name}", sch))
            evaluated += 1

    # 2. greedy grid, placements interleaved so a short time limit covers both
    grids = []
    for kind, v in kinds:
        pl = placement(kind, p, v)
        caps = warmup_caps(pl, costs)
        grids.append([(kind, pl, replace(pol, cap=cap))
                      for pol in policies(chunks=v, braid=braid) for cap in (caps, None)])
    order = [g[i] for i in range(max(map(len, grids))) for g in grids if i < len(g)]
    best_by_kind: dict[str, tuple[_Candidate, Policy, tuple[int, ...]]] = {}
    for kind, pl, pol in order:
        if out_of_time() and pool:
            break
        cand = evaluate(pl, pol)
        if cand is None:
            continue
        cand.origin = f"greedy {kind}: {cand.origin}"
        pool.append(cand)
        if kind not in best_by_kind or cand.score < best_by_kind[kind][0].score:
            best_by_kind[kind] = (cand, pol, pl)

    # 3a. braid the best unbraided orders (a TP all-reduce to hide)
    if braid and costs.ar > 0:
        pool.sort(key=lambda c: c.score)
        for cand in pool[:3]:
            if out_of_time():
                break
            if any(isinstance(a, Block) for acts in cand.schedule.actions for a in acts):
                continue
            braided_sch = braid_pass(cand.schedule, costs, mem, memory_limit, layers)
            if braided_sch is None:
                continue
            evaluated += 1
            res = simulate(braided_sch, costs, mem, layers, record_spans=False)
            pool.append(_Candidate(_sim_score(res, objective), cand.origin + " + braided",
                                   braided_sch))

    # 3b. per-rank caps: coordinate descent from the best greedy of each placement
    for kind, (cand, pol, pl) in sorted(best_by_kind.items(), key=lambda kv: kv[1][0].score):
        if out_of_time():
            break

        def scalar(trial: Policy, pl: tuple[int, ...] = pl) -> float | None:
            got = evaluate(pl, trial)
            return None if got is None else got.score[0] + 1e-12 * got.score[1]

        start_caps = pol.cap or warmup_caps(pl, costs)
        first = cand.score[0] + 1e-12 * cand.score[1]
        refined, _ = refine_caps(pol, start_caps, first, scalar, out_of_time)
        if refined.cap != pol.cap:
            got = evaluate(pl, refined)
            if got is not None:
                got.origin = f"greedy {kind}: {got.origin} (caps refined)"
                pool.append(got)

    pool.sort(key=lambda c: c.score)
    origin, best = pool[0].origin, pool[0].schedule
    best = replace(best, name="search", meta={**best.meta, "origin": origin,
                                               "memory_limit": memory_limit,
                                               "objective": objective})
    validate(best, memory_limit=memory_limit, mem=mem)
    assert max(peak_by_order(best, mem)) <= memory_limit + _EPS
    result = simulate(best, costs, mem, layers, record_spans=False)
    return SearchResult(
        schedule=best,
        result=result,
        origin=origin,
        seconds=time.perf_counter() - t0,
        evaluated=evaluated,
        memory_limit=memory_limit,
        objective=objective,
        baselines=[b for b, _ in baselines],
    )
