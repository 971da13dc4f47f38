"""`--partition auto`: the layer counts per global stage that minimise the
simulated step time of a schedule within a memory limit.

1. The classic balanced partition: contiguous runs of layers whose longest
   stage (layers plus the embedding on the first and the output layer on the
   last stage) is as short as possible, by dynamic programming over (stage,
   layers so far); ties keep the layers early.
2. The simulator judges: starting from the better of that and the even
   split, move one layer between two neighbouring stages while a move
   shortens the simulated step (steepest first) and keeps every rank's peak
   activation within the limit (while over it: move a layer between any two
   stages, taking the move that lowers the ranks' total excess most). What a
   stage costs is not all that matters:
   a V placement puts the first and the last stage on one rank, and a stage
   off the critical path may take more.

The even split is a candidate, so the answer is never slower than it (when
both fit the limit).
"""

from __future__ import annotations

from dataclasses import dataclass

from stp.schedule.ir import Schedule
from stp.sim.engine import simulate
from stp.sim.layered import LayeredCosts, even_partition
from stp.sim.result import SimResult

__all__ = ["AutoPartition", "auto_partition", "balanced_partition"]

_EPS = 1e-9
MAX_ROUNDS = 200
"""Most improving moves (each simulates 2 (S - 1) neighbours)."""


def balanced_partition(model: LayeredCosts, num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layer counts (each >= 1, summing to `num_layers`) minimising the
    longest stage's compute, stage extras included (the classic linear
    partition, exact by dynamic programming)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages of at least "
                         "one layer each")
    inf = float("inf")
    # best[s][n]: the smallest longest stage of stages 0..s-1 holding n layers
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    take = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(num_stages):
        left = num_stages - s - 1  # stages after this one, one layer each at least
        for n in range(s, num_layers - left):
            if best[s][n] == inf:
                continue
            for k in range(1, num_layers - left - n + 1):
                worst = max(best[s][n], model.stage_time(s, num_stages, k))
                if worst < best[s + 1][n + k] - _EPS:
                    best[s + 1][n + k], take[s + 1][n + k] = worst, k
    counts, n = [], num_layers
    for s in range(num_stages, 0, -1):
        counts.append(take[s][n])
        n -= take[s][n]
    return tuple(reversed(counts))


@dataclass(frozen=True)
class AutoPartition:
    counts: tuple[int, ...]
    result: SimResult
    """The simulated run with `counts` (no spans)."""
    even: SimResult
    """The simulated run with the even split, for comparison."""
    simulated: int
    """Partitions simulated."""


class _Judge:
    def __init__(self, schedule: Schedule, model: LayeredCosts, layers: int,
                 limit: float | None) -> None:
        self.schedule, self.model, self.layers, self.limit = schedule, model, layers, limit
        self.seen: dict[tuple[int, ...], SimResult] = {}

    def run(self, counts: tuple[int, ...]) -> SimResult:
        hit = self.seen.get(counts)
        if hit is None:
            hit = self.seen[counts] = simulate(
                self.schedule, layers=self.layers, record_spans=False,
                stages=self.model.table(counts))
        return hit

    def score(self, counts: tuple[int, ...]) -> tuple[float, float]:
        """(the ranks' total peak over the limit, makespan): fitting first,
        then fastest."""
        res = self.run(counts)
        limit = self.limit
        over = 0.0 if limit is None else sum(max(0.0, p - limit) for p in res.peak_activation)
        return (over if over > _EPS else 0.0, res.makespan)


def _neighbours(counts: tuple[int, ...], anywhere: bool) -> list[tuple[int, ...]]:
    """Partitions one layer away: between neighbouring stages, or (`anywhere`)
    between any two."""
    n = len(counts)
    pairs = [(a, b) for a in range(n) for b in range(n)
             if a != b and (anywhere or abs(a - b) == 1)]
    out = []
    for give, get in pairs:
        if counts[give] > 1:
            c = list(counts)
            c[give] -= 1
            c[get] += 1
            out.append(tuple(c))
    return out


def auto_partition(schedule: Schedule, model: LayeredCosts, num_layers: int, *,
                   layers: int = 1, memory_limit: float | None = None) -> AutoPartition:
    """The partition of `num_layers` layers over the schedule's global stages
    that `--partition auto` picks (module doc)."""
    n = schedule.num_stages
    judge = _Judge(schedule, model, layers, memory_limit)
    even = even_partition(num_layers, n)
    best = min((even, balanced_partition(model, num_layers, n)), key=judge.score)
    score = judge.score(best)
    for _ in range(MAX_ROUNDS):
        trial = min(_neighbours(best, anywhere=score[0] > 0), key=judge.score, default=None)
        if trial is None:
            break
        got = judge.score(trial)
        if not (got[0] < score[0] - _EPS or (got[0] <= score[0] + _EPS
                                             and got[1] < score[1] - _EPS)):
            break
        best, score = trial, got
    return AutoPartition(best, judge.run(best), judge.run(even), len(judge.seen))
