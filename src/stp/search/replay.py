"""A fast replay of pass-only schedules, for the local search's many trials.

Exact where the simulator's model reduces to whole passes: no TP collective
(costs.tp_time = 0: no all-reduce, all-gather or reduce-scatter), one layer
per chunk and no braided block. Then a pass starts when its rank is free and
its inputs are there (plus `comm` from another rank) and takes F = f/v,
B = b/v, W = w/v, BW = (b+w)/v ("Zero Bubble Pipeline Parallelism", arXiv
2401.10241, section 2), which is what `stp.sim.simulate` computes;
`tests/search/test_v_search.py` checks the two agree. Elsewhere the
search calls the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stp.schedule.ir import Action, Block, Kind, Pass, Schedule
from stp.sim.costs import Costs

__all__ = ["Player", "Timeline", "exact_for", "play"]

_KINDS = (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True)
class Timeline:
    start: list[list[float]]
    """Per rank, the start of each action."""
    end: list[list[float]]

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.end if e), default=0.0)

    def rank_end(self, r: int) -> float:
        return self.end[r][-1] if self.end[r] else 0.0


def exact_for(sch: Schedule, costs: Costs, layers: int) -> bool:
    """Whether `play` gives the simulator's timeline for this schedule."""
    if costs.tp_time != 0 or layers != 1:
        return False
    return not any(isinstance(a, Block) for acts in sch.actions for a in acts)


def play(sch: Schedule, costs: Costs) -> Timeline | None:
    """The timeline of a pass-only schedule; None if it deadlocks."""
    return Player(sch, costs).play(sch.actions)


class Player:
    """`play` for many orders of one schedule's passes: each pass is compiled
    once (duration, the results it needs with their send latency, the results
    it completes)."""

    def __init__(self, sch: Schedule, costs: Costs) -> None:
        self.num_stages, self.m, v = sch.num_stages, sch.num_microbatches, sch.chunks
        self.owner = sch.stage_to_rank
        self.comm = costs.comm
        self.dur = {Kind.F: costs.f / v, Kind.B: costs.b / v, Kind.W: costs.w / v,
                    Kind.BW: (costs.b + costs.w) / v}
        self.compiled: dict[Pass, tuple[float, list[tuple[int, float]], list[int]]] = {}

    def _key(self, stage: int, kind: Kind, mb: int) -> int:
        return (stage * 3 + _KINDS.index(kind)) * self.m + mb

    def _compile(self, p: Pass) -> tuple[float, list[tuple[int, float]], list[int]]:
        got = self.compiled.get(p)
        if got is None:
            r = self.owner[p.stage]
            needs = [(self._key(*d), self.comm if self.owner[d.stage] != r else 0.0)
                     for d in p.needs(self.num_stages)]
            got = (self.dur[p.kind], needs, [self._key(*d) for d in p.completes()])
            self.compiled[p] = got
        return got

    def play(self, actions: Sequence[Sequence[Action]]) -> Timeline | None:
        plans = []
        for acts in actions:
            plan = []
            for p in acts:
                assert isinstance(p, Pass), "play takes pass-only schedules"
                plan.append(self._compile(p))
            plans.append(plan)
        ready = [-1.0] * (3 * self.num_stages * self.m)
        start: list[list[float]] = [[] for _ in plans]
        end: list[list[float]] = [[] for _ in plans]
        free = [0.0] * len(plans)
        ptr = [0] * len(plans)
        waiting: dict[int, list[int]] = {}  # result -> ranks blocked on it
        todo = list(range(len(plans)))
        while todo:
            r = todo.pop()
            plan, k, t_free = plans[r], ptr[r], free[r]
            while k < len(plan):
                d, needs, done = plan[k]
                t = t_free
                for n, lag in needs:
                    got = ready[n]
                    if got < 0:
                        waiting.setdefault(n, []).append(r)
                        break
                    t = max(t, got + lag)
                else:
                    t_free = t + d
                    start[r].append(t)
                    end[r].append(t_free)
                    for n in done:
                        ready[n] = t_free
                        todo.extend(waiting.pop(n, ()))
                    k += 1
                    continue
                break
            ptr[r], free[r] = k, t_free
        if any(ptr[r] < len(plan) for r, plan in enumerate(plans)):
            return None
        return Timeline(start, end)
