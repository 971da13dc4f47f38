"""Local search on per-rank orders: move one action, guided by the critical
path, judged by the simulator.

A rank's end time is the length of a *critical chain*: walking back from its
last action, each action waited either for the action before it on its rank
(a rank edge) or for an input from another pass (a dependency edge). Moving
an action that is not on the chain cannot shorten it: every edge of the
chain survives such a move (a rank edge Y -> X may get actions put between
Y and X, which only delays X), so the chain, and the end time, stay at least
as long. The only moves that can help are those of a chain action across a
rank edge: X earlier, before Y, or Y later, after X.

The neighbourhood is therefore: for every rank edge Y -> X on the chain of
any rank's end, X moved 1..`reach` places earlier, or Y 1..`reach` places
later, without passing an action of its own rank that it depends on (or that
depends on it) or the same pass of another microbatch, and within the memory
limit. A move is kept when the simulated score improves: (objective, the
other of makespan and span, the sum of the ranks' end times; the last lets
the search walk along plateaus where several chains are equally long).
`improve` stops when no move of the neighbourhood improves the score (a
local optimum: by the argument above no move elsewhere can), or when out of
time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from stp.schedule.ir import Action, Done, Kind, Schedule, passes_of
from stp.schedule.memory import MemCosts, action_memory
from stp.schedule.validate import ScheduleError
from stp.search.replay import Player, exact_for
from stp.sim.costs import Costs
from stp.sim.engine import simulate
from stp.sim.result import SimResult
from stp.sim.stages import StageCosts

__all__ = ["Improved", "improve", "score_of"]

_EPS = 1e-9
Score = tuple[float, float, float]
Timing = tuple[list[list[float]], list[list[float]]]
"""Per rank, the start and the end of each action."""


@dataclass(frozen=True)
class Improved:
    schedule: Schedule
    score: Score
    evaluated: int
    """Orders timed."""
    moves: int
    """Moves kept."""
    converged: bool
    """True when no move of the neighbourhood improves the score."""


def score_of(res: SimResult, objective: str) -> Score:
    """(objective, the other measure, sum of rank end times), lower is better."""
    return _score(res.makespan, res.critical_rank.span, sum(r.end for r in res.ranks),
                  objective)


def _score(makespan: float, span: float, total: float, objective: str) -> Score:
    first, second = (makespan, span) if objective == "makespan" else (span, makespan)
    return first, second, total


def improve(
    sch: Schedule,
    costs: Costs,
    mem: MemCosts,
    limit: float,
    objective: str,
    out_of_time: Callable[[], bool],
    *,
    layers: int = 1,
    reach: int = 3,
    stages: StageCosts | None = None,
) -> Improved:
    """Hill-climb from `sch` by single moves (module docstring); `stages`:
    time the orders with this per-stage cost table (`stp.sim.stages`)."""
    judge = _Judge(sch, costs, mem, objective, layers, stages)
    return _Climb(sch, judge, mem, limit, reach).run(out_of_time)


class _Judge:
    """Times orders of one schedule's actions: `stp.search.replay` where it
    is exact (no all-reduce, whole passes), else the simulator."""

    def __init__(self, sch: Schedule, costs: Costs, mem: MemCosts, objective: str,
                 layers: int, stages: StageCosts | None = None) -> None:
        self.base, self.costs, self.mem, self.stages = sch, costs, mem, stages
        self.objective, self.layers = objective, layers
        exact = stages is None and exact_for(sch, costs, layers)
        self.player = Player(sch, costs) if exact else None

    def _schedule(self, actions: list[list[Action]]) -> Schedule:
        return replace(self.base, actions=tuple(tuple(a) for a in actions))

    def score(self, actions: list[list[Action]]) -> Score | None:
        """None when the order deadlocks."""
        if self.player is not None:
            got = self.player.play(actions)
            if got is None:
                return None
            return self._from_timing(actions, (got.start, got.end))
        try:
            res = simulate(self._schedule(actions), self.costs, self.mem, self.layers,
                           record_spans=False, stages=self.stages)
        except ScheduleError:
            return None
        return score_of(res, self.objective)

    def timing(self, actions: list[list[Action]]) -> Timing:
        if self.player is not None:
            got = self.player.play(actions)
            assert got is not None
            return got.start, got.end
        res = simulate(self._schedule(actions), self.costs, self.mem, self.layers,
                       stages=self.stages)
        start = [[float("inf")] * len(a) for a in actions]
        end = [[0.0] * len(a) for a in actions]
        for sp in res.spans:
            if sp.lane in ("compute", "tp"):
                r, k = sp.rank, sp.action_index
                start[r][k] = min(start[r][k], sp.start)
                end[r][k] = max(end[r][k], sp.end)
        return start, end

    def _from_timing(self, actions: list[list[Action]], timing: Timing) -> Score:
        start, end = timing
        ends = [e[-1] if e else 0.0 for e in end]
        spans = []
        for r, acts in enumerate(actions):
            first = next((start[r][k] for k, a in enumerate(acts)
                          if any(p.kind is Kind.F for p in passes_of(a))), 0.0)
            spans.append(ends[r] - first)
        return _score(max(ends, default=0.0), max(spans, default=0.0), sum(ends),
                      self.objective)


class _Climb:
    def __init__(self, sch: Schedule, judge: _Judge, mem: MemCosts, limit: float,
                 reach: int) -> None:
        self.base, self.judge, self.mem, self.limit, self.reach = sch, judge, mem, limit, reach
        self.actions = [list(a) for a in sch.actions]
        self.evaluated = 0
        self.moves = 0

    def result(self, score: Score, converged: bool) -> Improved:
        sch = replace(self.base, actions=tuple(tuple(a) for a in self.actions))
        return Improved(sch, score, self.evaluated, self.moves, converged)

    def run(self, out_of_time: Callable[[], bool]) -> Improved:
        score = self.judge.score(self.actions)
        assert score is not None, "the starting order deadlocks"
        while not out_of_time():
            found = self.first_better(score, out_of_time)
            if found is None:
                return self.result(score, converged=not out_of_time())
            r, order, score = found
            self.actions[r] = order
            self.moves += 1
        return self.result(score, converged=False)

    def first_better(self, score: Score, out_of_time: Callable[[], bool]
                     ) -> tuple[int, list[Action], Score] | None:
        """The first move of the neighbourhood that improves `score`."""
        tried: set[tuple[int, tuple[Action, ...]]] = set()
        if out_of_time():
            return None
        timing = self.judge.timing(self.actions)
        for r, k in _rank_edges(self.base, self.actions, timing, self.judge.costs.comm):
            for order in self.shifts(r, k):
                key = (r, tuple(order))
                if key in tried:
                    continue
                tried.add(key)
                if out_of_time():
                    return None
                got = self.evaluate(r, order)
                if got is not None and got < score:
                    return r, order, got
        return None

    def shifts(self, r: int, k: int) -> list[list[Action]]:
        """Orders of rank r with action k moved earlier, or action k-1 later,
        by 1..reach places, as far as their own-rank constraints allow."""
        acts, S = self.actions[r], self.base.num_stages
        out = []
        for j in range(1, self.reach + 1):  # X = acts[k] earlier
            if k - j < 0 or _tied(acts[k - j], acts[k], S):
                break
            out.append(acts[:k - j] + [acts[k]] + acts[k - j:k] + acts[k + 1:])
        y = k - 1
        for j in range(1, self.reach + 1):  # Y = acts[k-1] later
            if y + j >= len(acts) or _tied(acts[y], acts[y + j], S):
                break
            out.append(acts[:y] + acts[y + 1:y + j + 1] + [acts[y]] + acts[y + j + 1:])
        return out

    def evaluate(self, r: int, order: list[Action]) -> Score | None:
        """The score with rank r's order replaced; None if it breaks the memory
        limit or deadlocks."""
        if _peak(order, self.base.chunks, self.mem) > self.limit + _EPS:
            return None
        self.evaluated += 1
        return self.judge.score([*self.actions[:r], order, *self.actions[r + 1:]])


def _tied(first: Action, second: Action, num_stages: int) -> bool:
    """Whether `first` must stay before `second` on their rank: the second
    needs a result of the first, or both run the same (stage, kind)."""
    done = {d for p in passes_of(first) for d in p.completes()}
    for q in passes_of(second):
        if any(d in done for d in q.needs(num_stages)):
            return True
        if any(p.stage == q.stage and p.kind is q.kind for p in passes_of(first)):
            return True
    return False


def _peak(order: list[Action], chunks: int, mem: MemCosts) -> float:
    cur = peak = 0.0
    for a in order:
        alloc, free = action_memory(a, chunks, mem)
        cur += alloc
        peak = max(peak, cur)
        cur -= free
    return peak


def _rank_edges(sch: Schedule, actions: list[list[Action]], timing: Timing,
                comm: float) -> list[tuple[int, int]]:
    """(rank, k) for every rank edge (k-1 -> k) on the critical chain of each
    rank's end, the ranks that end last first, each chain from its start."""
    start, end = timing
    where: dict[Done, tuple[int, int]] = {}
    for r, acts in enumerate(actions):
        for k, a in enumerate(acts):
            for p in passes_of(a):
                for d in p.completes():
                    where[d] = (r, k)
    edges: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    ranks = sorted((r for r in range(len(actions)) if actions[r]), key=lambda r: -end[r][-1])
    for r in ranks:
        chain = []
        node: tuple[int, int] | None = (r, len(actions[r]) - 1)
        while node is not None:
            pred, by_rank = _binding(node, actions, sch.num_stages, timing, where, comm)
            if by_rank and node not in seen:
                seen.add(node)
                chain.append(node)
            node = pred
        edges.extend(reversed(chain))
    return edges


def _binding(node: tuple[int, int], actions: list[list[Action]], num_stages: int,
             timing: Timing, where: dict[Done, tuple[int, int]],
             comm: float) -> tuple[tuple[int, int] | None, bool]:
    """The predecessor `node` waited for last, and whether it is its rank's
    previous action; (None, False) at the start of a chain."""
    start, end = timing
    r, k = node
    best: tuple[float, tuple[int, int] | None, bool] = (-1.0, None, False)
    if k > 0:
        best = (end[r][k - 1], (r, k - 1), True)
    for p in passes_of(actions[r][k]):
        for d in p.needs(num_stages):
            src = where[d]
            t = end[src[0]][src[1]] + (comm if src[0] != r else 0.0)
            if t > best[0] + _EPS:
                best = (t, src, False)
    t0 = start[r][k]
    if best[1] is None or best[0] < t0 - 1e-6 * max(1.0, t0):
        return None, False  # nothing bound its start (time 0, or a wait of its own)
    return best[1], best[2]
