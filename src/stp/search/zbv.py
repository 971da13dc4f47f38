"""ZB-V built from the costs: the V construction of "Zero Bubble Pipeline
Parallelism" (Qi, Wan, Huang, Lin, ICLR 2024, arXiv 2401.10241, section 6,
as its published scheduler builds it).

`stp.schedule.gen_v.zb_v` lays passes out by a fixed per-rank pattern (the
one torch's `ScheduleZBVZeroBubble` uses), which has zero bubble when
T_F = T_B = T_W. This construction places the same kinds of passes by the
profiled times instead, playing the pipeline forward rank by rank:

* warm-up: one chunk-0 forward on every rank; then, from the last rank up,
  each rank runs chunk-0 forwards (one more on it and on every rank above
  it, so they keep pace) while they fit before its first chunk-1 input
  arrives and its memory keeps room for the chunk-1 forwards still to
  come; then its chunk-1 forward. Ranks then catch up with the forwards of
  the rank above them, alternating chunks.
* steady state, 2m rounds: every rank runs its next backward (chunk 1's,
  which heads the backward, when its input is there, else chunk 0's),
  ranks ordered along the backward's way; then its next forward. Before a
  pass whose input arrives later than the rank is free, pending W fill the
  gap while they fit it, and one more W when the wait exceeds the rank's
  slack, the most idle time another rank has (`fill_b` / `fill_f` allow
  that before backwards of chunk 1 / forwards); a W also runs whenever
  memory is too full for a forward.
* the W left run at the end.

The slack starts at each rank's own idle time; the construction is then run
again with the idle time of the previous run as the slack allowed to each
rank, as long as the longest idle time drops. Memory is counted as the
simulator does: F adds M_B/2, B frees (M_B - M_W)/2, W frees M_W/2; a limit
of `p M_B` gives ZB-V's memory, a lower one a V schedule that fits it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from stp.schedule.ir import Done, Kind, Pass, Schedule, v_placement
from stp.schedule.memory import MemCosts
from stp.sim.costs import Costs

__all__ = ["cost_aware_v", "cost_aware_v_variants"]

_EPS = 1e-9


class _Stuck(Exception):
    """A pass's input was not placed yet, or memory ran out: no schedule."""


@dataclass
class _Rank:
    stage0: int
    stage1: int
    free: float = 0.0
    memory: float = 0.0
    idle: float = 0.0
    started: bool = False


def cost_aware_v(p: int, m: int, costs: Costs, mem: MemCosts, limit: float,
                 fill_f: bool = True, fill_b: bool = True) -> Schedule | None:
    """The construction of the module docstring, or None if it gets stuck
    under `limit` (units of M_B)."""
    slack: list[float] | None = None
    best: tuple[float, _Build] | None = None
    for _ in range(2 * p):  # each run is kept only while its worst idle time drops
        build = _Build(p, m, costs, mem, limit, fill_f, fill_b, slack)
        try:
            build.run()
        except _Stuck:
            break
        if any(len(o) != 6 * m for o in build.orders):
            break  # 2m rounds did not place every pass
        worst = max(r.idle for r in build.ranks)
        if best is not None and worst >= best[0] - _EPS:
            break
        best, slack = (worst, build), [r.idle for r in build.ranks]
    if best is None:
        return None
    return Schedule(
        name="zb-v-costs", num_ranks=p, num_microbatches=m, stage_to_rank=v_placement(p),
        actions=tuple(tuple(o) for o in best[1].orders),
        meta={"chunks": 2, "placement": "v", "origin": "cost-aware zb-v",
              "fill_f": fill_f, "fill_b": fill_b},
    )


def cost_aware_v_variants(p: int, m: int, costs: Costs, mem: MemCosts, limit: float,
                          out_of_time: Callable[[], bool] = lambda: False
                          ) -> list[tuple[str, Schedule]]:
    """The construction with each setting of its two W-filling switches (as
    many as there is time for)."""
    out = []
    for fill_b in (True, False):
        for fill_f in (True, False):
            if out_of_time():
                return out
            sch = cost_aware_v(p, m, costs, mem, limit, fill_f, fill_b)
            if sch is not None:
                out.append((f"cost-aware zb-v (fill_b={fill_b}, fill_f={fill_f})", sch))
    return out


class _Build:
    def __init__(self, p: int, m: int, costs: Costs, mem: MemCosts, limit: float,
                 fill_f: bool, fill_b: bool, slack: list[float] | None) -> None:
        self.p, self.m, self.costs, self.limit = p, m, costs, limit
        self.fill_f, self.fill_b, self.slack = fill_f, fill_b, slack
        self.dur = {Kind.F: costs.f / 2, Kind.B: costs.b / 2, Kind.W: costs.w / 2}
        self.delta = {Kind.F: mem.m_b / 2, Kind.B: -(mem.m_b - mem.m_w) / 2,
                      Kind.W: -mem.m_w / 2}
        self.num_stages = 2 * p
        self.ranks = [_Rank(r, 2 * p - 1 - r) for r in range(p)]
        self.count: dict[tuple[int, Kind], int] = {}
        self.done: dict[Done, float] = {}
        self.pending: list[deque[Pass]] = [deque() for _ in range(p)]
        self.orders: list[list[Pass]] = [[] for _ in range(p)]

    def n(self, stage: int, kind: Kind) -> int:
        return self.count.get((stage, kind), 0)

    def run(self) -> None:
        self.warm_up()
        for _ in range(2 * self.m):
            self.backward_round()
            self.forward_round()
        for r in range(self.p):
            while self.pending[r]:
                self.put_w(r)

    # -- the three phases ----------------------------------------------------------

    def warm_up(self) -> None:
        p, m = self.p, self.m
        for r in range(p):
            self.put(r, self.ranks[r].stage0, Kind.F)
        for r in range(p - 1, -1, -1):
            rank = self.ranks[r]
            if r < p - 1:
                arrival = self.arrival(Pass(rank.stage1, Kind.F, 0), r)
                while (rank.memory + self.delta[Kind.F] * (2 + 2 * r) <= self.limit + _EPS
                       and rank.free + self.dur[Kind.F] <= arrival + _EPS
                       and self.n(rank.stage0, Kind.F) < m):
                    for j in range(r + 1):
                        if self.n(self.ranks[j].stage0, Kind.F) < m:
                            self.put(j, self.ranks[j].stage0, Kind.F)
            self.put(r, rank.stage1, Kind.F)
        chunk, idle_turns = 0, 0
        for r in range(1, p):
            while self._behind(r):
                placed = 0
                for j in range(p - 1, r - 1, -1):
                    stage = self.ranks[j].stage0 if chunk == 0 else self.ranks[j].stage1
                    if self.n(stage, Kind.F) < m:
                        self.put(j, stage, Kind.F)
                        placed += 1
                idle_turns = 0 if placed else idle_turns + 1
                if idle_turns == 2:
                    raise _Stuck(f"rank {r} cannot catch up with rank {r - 1}")
                chunk = 1 - chunk

    def _behind(self, r: int) -> bool:
        """Rank r has run fewer forwards than rank r-1, or no more chunk-1 ones."""
        here, above = self.ranks[r], self.ranks[r - 1]
        f0, f1 = self.n(here.stage0, Kind.F), self.n(here.stage1, Kind.F)
        g0, g1 = self.n(above.stage0, Kind.F), self.n(above.stage1, Kind.F)
        return f0 + f1 < g0 + g1 or f1 <= g1 < self.m

    def backward_round(self) -> None:
        down, up = [], []  # chunk 1's backward runs down the ranks, chunk 0's up
        for r, rank in enumerate(self.ranks):
            b1, b0 = self.n(rank.stage1, Kind.B), self.n(rank.stage0, Kind.B)
            if b1 >= self.m and b0 >= self.m:
                continue
            if b0 >= b1:
                down.append(r)
            elif r == self.p - 1 or b1 >= self.m or self.placed(rank.stage0 + 1, Kind.B, b0):
                up.append(r)
            else:
                down.append(r)
        for r in reversed(up):
            self.before(r, Pass(self.ranks[r].stage0, Kind.B, 0), fill=True)
        for r in down:
            self.before(r, Pass(self.ranks[r].stage1, Kind.B, 0), fill=self.fill_b)

    def forward_round(self) -> None:
        for r, rank in enumerate(self.ranks):
            f0, f1 = self.n(rank.stage0, Kind.F), self.n(rank.stage1, Kind.F)
            if f1 >= self.m:
                continue
            if f1 >= f0:
                stage = rank.stage0
            elif r == self.p - 1 or self.placed(rank.stage1 - 1, Kind.F, f1):
                stage = rank.stage1
            elif f0 < self.m and (r == 0 or self.placed(rank.stage0 - 1, Kind.F, f0)):
                stage = rank.stage0
            else:
                continue
            while rank.memory + self.delta[Kind.F] > self.limit + _EPS:
                self.put_w(r)
            self.before(r, Pass(stage, Kind.F, 0), fill=self.fill_f)

    # -- one pass, with the W that fill the wait before it -----------------------

    def before(self, r: int, kind_of: Pass, fill: bool) -> None:
        """Run the next pass of (stage, kind) on rank r, after the W that fit
        the wait for its input (and one more if the wait exceeds the slack)."""
        p = Pass(kind_of.stage, kind_of.kind, self.n(kind_of.stage, kind_of.kind))
        arrival = self.arrival(p, r)
        rank = self.ranks[r]
        while self.pending[r] and arrival >= rank.free + self.dur[Kind.W] - _EPS:
            self.put_w(r)
        if self.pending[r] and fill and arrival - rank.free > self.allowed(r) + _EPS:
            self.put_w(r)
        self.put(r, p.stage, p.kind)

    def allowed(self, r: int) -> float:
        """How much more idle time rank r may take: the worst idle time so
        far (or allowed by the previous run) minus its own."""
        worst = max(x.idle for x in self.ranks)
        if self.slack is not None:
            worst = max(worst, max(self.slack) - self.slack[r])
        return worst - self.ranks[r].idle

    def arrival(self, p: Pass, r: int) -> float:
        """When the inputs of p coming from other ranks are there (0 if none);
        raises _Stuck if one was not placed yet."""
        t = 0.0
        for d in p.needs(self.num_stages):
            if self._owner(d.stage) == r:
                continue
            if d not in self.done:
                raise _Stuck(f"{p} needs {d}")
            t = max(t, self.done[d] + self.costs.comm)
        return t

    def placed(self, stage: int, kind: Kind, mb: int) -> bool:
        return Done(stage, kind, mb) in self.done

    def _owner(self, stage: int) -> int:
        return stage if stage < self.p else 2 * self.p - 1 - stage

    def put_w(self, r: int) -> None:
        if not self.pending[r]:
            raise _Stuck(f"rank {r}: memory full and no W to run")
        w = self.pending[r].popleft()
        self.put(r, w.stage, Kind.W)

    def put(self, r: int, stage: int, kind: Kind) -> None:
        rank = self.ranks[r]
        p = Pass(stage, kind, self.n(stage, kind))
        if p.mb >= self.m:
            raise _Stuck(f"{p}: only {self.m} microbatches")
        t = rank.free
        for d in p.needs(self.num_stages):
            if d not in self.done:
                raise _Stuck(f"{p} needs {d}")
            t = max(t, self.done[d] + (self.costs.comm if self._owner(d.stage) != r else 0.0))
        if rank.memory + self.delta[kind] > self.limit + _EPS:
            raise _Stuck(f"{p} over the memory limit")
        if rank.started:
            rank.idle += t - rank.free
        rank.started = True
        rank.free = t + self.dur[kind]
        rank.memory += self.delta[kind]
        for d in p.completes():
            self.done[d] = rank.free
        if kind is Kind.B:
            self.pending[r].append(Pass(stage, Kind.W, p.mb))
        self.count[(stage, kind)] = p.mb + 1
        self.orders[r].append(p)
