"""Greedy list scheduler: build per-rank orders by playing the pipeline forward.

This is the construction step of the search, after the Zero Bubble heuristic
("Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024, arXiv 2401.10241,
section 3.1): in the warm-up a rank runs as many forwards as memory allows,
then backwards and forwards as they arrive, and a weight-gradient pass W
fills a gap it fits in or frees memory when the limit is hit; the leftover W
run at the end. We generalise it to any placement (one chunk, looped, V), to
full backwards, and to STP's braided blocks ("Synergistic Tensor and
Pipeline Parallelism", Qi, Peng et al., NeurIPS 2025, arXiv 2510.27257), with
the choices exposed as `Policy` knobs. The state of one run is a `_Greedy`
object; `decide` is the rule below, one named step per branch.

Time model (internal estimate; the simulator is the judge): per chunk pass
F = (f+ar)/v, B = (b+ar)/v, W = w/v, BW = (b+w)/v + max(0, ar-w)/v; a braided
block takes its passes' compute, its all-reduces hidden. A pass's output
reaches another rank `comm` after its action ends. With ar = 0 and no blocks
this is the simulator's own model, so the greedy's timeline is exact.

Memory and deadlock freedom. A microbatch is *admitted* on a rank by the
forward of its first stage there; forwards of a stage run in microbatch
order, backwards need no memory and a W can always run. Admission keeps
room for the admitted microbatches' later forwards on the rank:

    v = 1    admit while resident + M_B <= limit
    v = 2    admit while resident + 2 (M_B/2) <= limit: one chunk forward of
             headroom, so the oldest microbatch's second-chunk forward (the
             only one a rank can be waiting for, in microbatch order) fits
    v >= 3   admission reserves all v forwards (resident + reserved + M_B)

so the peak is within the limit by construction, and a limit of M_B (one
microbatch at a time) always builds. The `tight` knob (v = 2) drops the
headroom while a second-chunk activation is alive, as ZB-V's steady state
does; that is not guaranteed to make progress, so a build that gets stuck
(work left, nothing able to run) returns None and the search moves on.
The `guard_f` knob keeps a forward from starting when a backward, or a
deeper forward, arrives before it would end (their chains are critical).

    rank free at c, global time g >= c:
      ready B or F (arrived by g)?  run by policy, at max(c, arrival)
      else a W pending and (eager, or memory blocked, or the next arrival
        leaves a gap >= W after c)?  run W at c   (W has no dependants, so
        filling the idle time since c is sound)
      else wait for the next arrival
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from stp.schedule.ir import Action, Block, Kind, Pass, Schedule
from stp.schedule.memory import MemCosts
from stp.search.space import Policy
from stp.sim.costs import Costs

__all__ = ["Built", "build"]

_EPS = 1e-9


@dataclass(frozen=True)
class Built:
    """A greedy schedule and its timeline by the internal model (exact when
    ar = 0 and no block is braided: then it is the simulator's model)."""

    schedule: Schedule
    makespan: float
    max_span: float
    """Longest rank span, first forward start to last end (Zero Bubble's cost)."""
    exact: bool


def build(
    stage_to_rank: tuple[int, ...],
    num_microbatches: int,
    costs: Costs,
    mem: MemCosts,
    limit: float,
    policy: Policy,
    *,
    name: str = "search",
) -> Built | None:
    """One schedule by the greedy rules above; None if the limit admits nothing."""
    if mem.m_b > limit + _EPS:
        return None
    return _Greedy(stage_to_rank, num_microbatches, costs, mem, limit, policy).run(name)


@dataclass
class _View:
    """What a free rank sees at global time g: ready passes and later arrivals."""

    bs: list[tuple[float, int, int]] = field(default_factory=list)
    """Ready backwards (arrival, stage, microbatch), earliest first."""
    fs: list[tuple[float, int, int]] = field(default_factory=list)
    """Ready admissible forwards, in the policy's order."""
    future: list[float] = field(default_factory=list)
    future_b: list[float] = field(default_factory=list)
    future_f: list[tuple[float, int]] = field(default_factory=list)
    unknown: bool = False
    """Some next pass's input is not even scheduled yet."""
    blocked: bool = False
    """A ready forward is held back by memory (or the cap)."""
    nxt: float = float("inf")
    """When the next input is expected (or a guess, if unknown)."""


class _Greedy:
    """The state of one greedy run: per stage which pass runs next and when
    outputs are ready, per rank memory, in-flight count and pending W."""

    def __init__(self, owner: tuple[int, ...], m: int, costs: Costs, mem: MemCosts,
                 limit: float, policy: Policy) -> None:
        S = len(owner)
        P = max(owner) + 1
        v = S // P
        self.owner, self.m, self.S, self.P, self.v = owner, m, S, P, v
        self.costs, self.mem, self.limit, self.policy = costs, mem, limit, policy
        self.stages_of = [[s for s in range(S) if owner[s] == r] for r in range(P)]
        self.entry = [st[0] for st in self.stages_of]
        self.f_alloc, self.b_free, self.w_free = mem.m_b / v, (mem.m_b - mem.m_w) / v, mem.m_w / v
        ar = costs.tp_time
        self.d_f, self.d_b, self.d_w = (costs.f + ar) / v, (costs.b + ar) / v, costs.w / v
        self.d_bw = (costs.b + costs.w + max(0.0, ar - costs.w)) / v
        self.f_end: list[list[float | None]] = [[None] * m for _ in range(S)]
        self.b_end: list[list[float | None]] = [[None] * m for _ in range(S)]
        self.next_f, self.next_b = [0] * S, [0] * S
        self.wq: list[deque[Pass]] = [deque() for _ in range(P)]
        self.cur = [0.0] * P  # resident activation memory
        self.inflight = [0] * P
        self.t_free = [0.0] * P
        self.first_f = [float("inf")] * P
        self.left = [3 * len(st) * m for st in self.stages_of]  # F, B, W passes still to run
        self.actions: list[list[Action]] = [[] for _ in range(P)]
        # v = 2: one chunk forward of headroom lets the oldest microbatch's second
        # forward always fit; v >= 3: reserve every admitted microbatch's forwards.
        self.reserve = v >= 3
        self.headroom = self.f_alloc if v == 2 else 0.0
        self.reserved = [0.0] * P
        self.deep_live = [0] * P  # v = 2: second-chunk activations alive (their B frees memory)
        self.tight = policy.tight and v == 2
        self.heap: list[tuple[float, int, int]] = [(0.0, r, r) for r in range(P)]
        self.seq = P

    # -- the run ----------------------------------------------------------------

    def run(self, name: str) -> Built | None:
        while self.heap:
            g, _, r = heapq.heappop(self.heap)
            if self.t_free[r] > g + _EPS or not self.left[r]:
                continue
            self.decide(r, g)
        if any(self.next_f[s] < self.m or self.next_b[s] < self.m for s in range(self.S)):
            return None  # stuck: only with the `tight` knob (see module docstring)
        if any(self.wq):
            return None
        sch = Schedule(
            name=name,
            num_ranks=self.P,
            num_microbatches=self.m,
            stage_to_rank=tuple(self.owner),
            actions=tuple(tuple(a) for a in self.actions),
            meta={"origin": "greedy", "policy": self.policy.label()},
        )
        braided = any(isinstance(a, Block) for acts in self.actions for a in acts)
        exact = self.costs.tp_time == 0 and not braided
        spans = [self.t_free[r] - self.first_f[r] for r in range(self.P)]
        return Built(sch, max(self.t_free), max(spans), exact)

    def decide(self, r: int, g: float) -> None:
        """Rank r is free and the clock is at g: run one action or wait."""
        view = self.survey(r, g)
        if self.policy.w_now and self.wq[r]:
            self.finish(r, self.take_w(r, 1), self.t_free[r], self.d_w)
            return
        if self.policy.braid and view.fs:
            self.run_braided(r, g, view)
            return
        if view.bs and (self.policy.prefer_b or not view.fs):
            self.run_backward(r, view.bs[0])
            return
        if view.fs and self.try_forward(r, view):
            return
        if self.wq[r] and self.w_allowed(r, view):
            self.finish(r, self.take_w(r, 1), self.t_free[r], self.d_w)
            return
        if view.future:
            self.wake(min(view.future), r)

    # -- steps of `decide` ------------------------------------------------------

    def survey(self, r: int, g: float) -> _View:
        """Sort the next F and B of each of r's stages into ready, later and unknown."""
        view = _View()
        for s in self.stages_of[r]:
            i = self.next_b[s]
            if i < self.m:
                a = self.b_arrival(s, i)
                if a is None:
                    view.unknown = True
                elif a <= g + _EPS:
                    view.bs.append((a, s, i))
                else:
                    view.future.append(a)
                    view.future_b.append(a)
            i = self.next_f[s]
            if i < self.m:
                a = self.f_arrival(s, i)
                if a is None:
                    view.unknown = True
                elif a > g + _EPS:
                    view.future.append(a)
                    view.future_f.append((a, s))
                elif self.admissible(r, s):
                    view.fs.append((a, s, i))
                else:
                    view.blocked = True
        view.bs.sort(key=lambda x: (x[0], -x[1]))
        if self.policy.deep_first:
            view.fs.sort(key=lambda x: -x[1])
        else:
            view.fs.sort(key=lambda x: (x[2], -x[1]))
        view.nxt = min(view.future) if view.future else float("inf")
        if view.unknown:
            view.nxt = min(view.nxt, g + min(self.d_f, self.d_b))
        return view

    def run_backward(self, r: int, ready: tuple[float, int, int]) -> None:
        a, s, i = ready
        bp = Pass(s, Kind.B if self.policy.split else Kind.BW, i)
        dur = self.d_b if bp.kind is Kind.B else self.d_bw
        self.finish(r, (bp,), max(self.t_free[r], a), dur)

    def try_forward(self, r: int, view: _View) -> bool:
        """Run the first ready forward unless the `guard_f` knob holds it back:
        a backward, or a deeper forward, arriving while it would run goes first
        (its chain is the critical path). Held back, the rank waits for that
        arrival unless a pending W fits the gap (False: the caller runs it)."""
        a, s, i = view.fs[0]
        start = max(self.t_free[r], a)
        urgent = view.future_b + [t for t, s2 in view.future_f if s2 > s]
        if not (self.policy.guard_f and urgent and start + self.d_f > min(urgent) + _EPS):
            self.finish(r, (Pass(s, Kind.F, i),), start, self.d_f)
            return True
        if self.wq[r] and self.w_fits(r, view):
            return False
        self.wake(min(urgent), r)
        return True

    def w_allowed(self, r: int, view: _View) -> bool:
        """A pending W runs now when eager, when memory blocks a forward, when
        the rank has no F or B left, or when it fits before the next arrival."""
        done_fb = all(self.next_f[s] >= self.m and self.next_b[s] >= self.m
                      for s in self.stages_of[r])
        return self.policy.eager_w or view.blocked or done_fb or self.w_fits(r, view)

    def w_fits(self, r: int, view: _View) -> bool:
        return view.nxt - self.t_free[r] >= self.d_w - _EPS

    def run_braided(self, r: int, g: float, view: _View) -> None:
        """STP blocks: the first ready F with a ready B (F+B, or F+BW), else
        with pending W (enough to cover its all-reduce), else with a second
        ready forward, else alone."""
        costs, v, c = self.costs, self.v, self.t_free[r]
        a, s, i = view.fs[0]
        fp = Pass(s, Kind.F, i)
        if view.bs:
            ab, sb, ib = view.bs[0]
            bk = Kind.B if self.policy.braid_defer_w else Kind.BW
            dur = (costs.f + costs.b + (0 if bk is Kind.B else costs.w)) / v
            self.finish(r, (fp, Pass(sb, bk, ib)), max(c, a, ab), dur)
            return
        pending = self.wq[r]
        if pending and self.policy.braid_defer_w:
            k = max(1, min(len(pending), round(costs.tp_time / costs.w) if costs.w > 0 else 1))
            dur = (costs.f + k * costs.w + max(0.0, costs.tp_time - k * costs.w)) / v
            self.finish(r, (fp, *self.take_w(r, k)), max(c, a), dur)
            return
        second = self.second_forward(r, s, i, g)
        if second is not None:
            self.finish(r, (fp, second[0]), max(c, a, second[1]), 2 * costs.f / v)
            return
        self.finish(r, (fp,), max(c, a), self.d_f)

    def second_forward(self, r: int, s: int, i: int, g: float) -> tuple[Pass, float] | None:
        """A second ready, admissible forward to braid with F(s, i) (F with F)."""
        extra = self.mem.m_b if self.reserve else self.f_alloc
        for s2 in self.stages_of[r]:
            i2 = i + 1 if s2 == s else self.next_f[s2]
            if i2 >= self.m:
                continue
            a = self.f_arrival(s2, i2)
            if a is None or a > g + _EPS or not self.admissible(r, s2, extra):
                continue
            if s2 == s + 1 and i2 == i:
                continue  # depends on the first
            return Pass(s2, Kind.F, i2), a
        return None

    # -- arrivals, admission, commits -------------------------------------------

    def comm(self, a: int, b: int) -> float:
        return self.costs.comm if self.owner[a] != self.owner[b] else 0.0

    def f_arrival(self, s: int, i: int) -> float | None:
        if s == 0:
            return 0.0
        e = self.f_end[s - 1][i]
        return None if e is None else e + self.comm(s - 1, s)

    def b_arrival(self, s: int, i: int) -> float | None:
        fe = self.f_end[s][i]
        if fe is None:
            return None
        if s == self.S - 1:
            return fe
        be = self.b_end[s + 1][i]
        return None if be is None else max(fe, be + self.comm(s + 1, s))

    def admissible(self, r: int, s: int, extra: float = 0.0) -> bool:
        """Whether a forward of stage s fits rank r's memory (module docstring)."""
        cur = self.cur[r]
        if s != self.entry[r]:
            return self.reserve or cur + extra + self.f_alloc <= self.limit + _EPS
        cap = self.policy.cap
        if cap is not None and self.inflight[r] + (1 if extra else 0) >= cap[r]:
            return False
        if self.reserve:
            need = self.mem.m_b
        else:
            need = self.f_alloc + (0.0 if self.tight and self.deep_live[r] else self.headroom)
        return cur + self.reserved[r] + extra + need <= self.limit + _EPS

    def wake(self, t: float, r: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, r))

    def take_w(self, r: int, k: int) -> tuple[Pass, ...]:
        return tuple(self.wq[r].popleft() for _ in range(k))

    def finish(self, r: int, ps: tuple[Pass, ...], start: float, dur: float) -> None:
        """Commit one action: memory, counters, completion times, wake-ups."""
        end = start + dur
        for p in ps:
            if p.kind is Kind.F:
                self.allocate(r, p, start)
        for p in ps:
            self.complete(r, p, end)
        self.actions[r].append(ps[0] if len(ps) == 1 else Block(ps))
        self.t_free[r] = end
        self.wake(end, r)

    def allocate(self, r: int, p: Pass, start: float) -> None:
        self.first_f[r] = min(self.first_f[r], start)
        self.cur[r] += self.f_alloc
        if p.stage == self.entry[r]:
            self.inflight[r] += 1
            if self.reserve:
                self.reserved[r] += self.mem.m_b - self.f_alloc
        else:
            self.deep_live[r] += 1
            if self.reserve:
                self.reserved[r] -= self.f_alloc

    def complete(self, r: int, p: Pass, end: float) -> None:
        s, i = p.stage, p.mb
        self.left[r] -= 2 if p.kind is Kind.BW else 1
        if p.kind is Kind.F:
            self.next_f[s] += 1
            self.f_end[s][i] = end
            if s + 1 < self.S:
                self.wake(end + self.comm(s, s + 1), self.owner[s + 1])
            return
        if p.kind is Kind.W:
            self.cur[r] -= self.w_free
            return
        self.next_b[s] += 1
        self.b_end[s][i] = end
        self.cur[r] -= self.b_free if p.kind is Kind.B else self.b_free + self.w_free
        if p.kind is Kind.B:
            self.wq[r].append(Pass(s, Kind.W, i))
        if s == self.entry[r]:
            self.inflight[r] -= 1
        else:
            self.deep_live[r] -= 1
        if s > 0:
            self.wake(end + self.comm(s, s - 1), self.owner[s - 1])
