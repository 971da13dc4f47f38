"""Improvement steps after the greedy construction, judged by the simulator.

* `refine_caps`: coordinate descent on the per-rank in-flight caps of a greedy
  policy (one rank's cap up or down by one, kept when the score improves),
  the per-rank counterpart of the Zero Bubble heuristic's grid search
  ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 3.1).
* `braid_pass`: turn adjacent passes of an order into STP braided blocks
  ("Synergistic Tensor and Pipeline Parallelism", arXiv 2510.27257, section
  3: F with B, F with BW, F with W, F with F) where the second pass's input
  was already there when the forward started in the unbraided run, so
  braiding delays neither pass and cannot create a cycle (a pass whose input
  exists before the forward starts cannot depend on it). The result is kept
  only if it fits the memory limit and validates. The start and output times
  come from the simulator's spans, each mapped to its pass through the
  action it belongs to (`Span.rank`, `Span.action_index`, stage and
  microbatch), not by re-parsing span names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from stp.schedule.ir import Action, Block, Done, Kind, Pass, Schedule, passes_of
from stp.schedule.memory import MemCosts, peak_by_order
from stp.schedule.validate import ScheduleError, validate
from stp.search.space import Policy
from stp.sim.costs import Costs
from stp.sim.engine import simulate
from stp.sim.result import Span

__all__ = ["refine_caps", "braid_pass"]

_EPS = 1e-9


def refine_caps(
    policy: Policy,
    caps: tuple[int, ...],
    score: float,
    evaluate: Callable[[Policy], float | None],
    out_of_time: Callable[[], bool],
) -> tuple[Policy, float]:
    """Coordinate descent on `policy.cap` from `caps`; returns the best policy
    and its score (lower is better). `evaluate` returns None for a cap vector
    that builds nothing."""
    best = replace(policy, cap=caps)
    improved = True
    while improved and not out_of_time():
        improved = False
        for r in range(len(caps)):
            for step in (1, -1):
                if out_of_time():
                    return best, score
                cur = list(best.cap or caps)
                if cur[r] + step < 1:
                    continue
                cur[r] += step
                trial = replace(best, cap=tuple(cur))
                got = evaluate(trial)
                if got is not None and got < score - _EPS:
                    best, score, improved = trial, got, True
                    break
    return best, score


def _done_times(
    sch: Schedule, costs: Costs, mem: MemCosts, layers: int
) -> tuple[dict[tuple[int, int], float], dict[Done, float]]:
    """(start of each action by (rank, position), time each result is ready)
    of one simulated run."""
    res = simulate(sch, costs, mem, layers)
    start: dict[tuple[int, int], float] = {}
    done: dict[Done, float] = {}
    for sp in res.spans:
        if sp.lane not in ("compute", "tp"):
            continue
        k = (sp.rank, sp.action_index)
        if sp.lane == "compute":
            start[k] = min(start.get(k, sp.start), sp.start)
        for d in _pass_of(sch, sp).completes():
            done[d] = max(done.get(d, sp.end), sp.end)
    return start, done


def _pass_of(sch: Schedule, sp: Span) -> Pass:
    """The pass a span belongs to: the pass of its action with the span's stage
    and microbatch (unique in a block: braided passes are independent, so they
    never share both)."""
    ps = passes_of(sch.actions[sp.rank][sp.action_index])
    return next(p for p in ps if p.stage == sp.stage and p.mb == sp.mb)


def braid_pass(
    sch: Schedule, costs: Costs, mem: MemCosts, limit: float, layers: int = 1
) -> Schedule | None:
    """Braid adjacent independent passes (see module docstring); None if nothing
    could be braided or the result breaks the limit."""
    start, done = _done_times(sch, costs, mem, layers)
    owner = sch.stage_to_rank
    S = sch.num_stages

    def ready(p: Pass, rank: int) -> float:
        t = 0.0
        for d in p.needs(S):
            got = done[d]
            if owner[d.stage] != rank:
                got += costs.comm
            t = max(t, got)
        return t

    w_per_f = max(1, round(costs.tp_time / costs.w)) if costs.w > 0 else 1
    new_actions: list[tuple[Action, ...]] = []
    merged = 0
    for r, acts in enumerate(sch.actions):
        out: list[Action] = []
        i = 0
        while i < len(acts):
            a = acts[i]
            nxt = acts[i + 1] if i + 1 < len(acts) else None
            if isinstance(a, Pass) and isinstance(nxt, Pass):
                t0 = start[(r, i)]
                if a.kind is Kind.F and ready(nxt, r) <= t0 + _EPS:
                    group = [a, nxt]
                    j = i + 2
                    while (
                        nxt.kind is Kind.W and len(group) <= w_per_f and j < len(acts)
                        and isinstance(acts[j], Pass) and acts[j].kind is Kind.W
                    ):
                        group.append(acts[j])
                        j += 1
                    out.append(Block(tuple(group)))
                    merged += 1
                    i = j
                    continue
                if (
                    a.kind in (Kind.B, Kind.BW) and nxt.kind is Kind.F
                    and ready(nxt, r) <= t0 + _EPS
                ):
                    out.append(Block((nxt, a)))
                    merged += 1
                    i += 2
                    continue
            out.append(a)
            i += 1
        new_actions.append(tuple(out))
    if not merged:
        return None
    braided = replace(sch, actions=tuple(new_actions), meta=dict(sch.meta))
    if max(peak_by_order(braided, mem)) > limit + _EPS:
        return None
    try:
        validate(braided)
    except ScheduleError:
        return None
    return braided
