"""Greedy list scheduler: build per-rank orders by playing the pipeline forward.

This is the construction step of the search, after the Zero Bubble heuristic
(Qi et al., ICLR 2024, seed 002, section 3.1): in the warm-up a rank runs as
many forwards as memory allows, then backwards and forwards as they arrive,
and a weight-gradient pass W fills a gap it fits in or frees memory when the
limit is hit; the leftover W run at the end. We generalise it to any
placement (one chunk, looped, V), to full backwards, and to STP's braided
blocks (seed 000), with the choices exposed as `Policy` knobs.

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
from dataclasses import dataclass

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
    owner = stage_to_rank
    S, m = len(owner), num_microbatches
    P = max(owner) + 1
    v = S // P
    if mem.m_b > limit + _EPS:
        return None
    stages_of = [[s for s in range(S) if owner[s] == r] for r in range(P)]
    entry = [st[0] for st in stages_of]
    f_alloc, b_free, w_free = mem.m_b / v, (mem.m_b - mem.m_w) / v, mem.m_w / v
    ar = costs.ar
    d_f, d_b, d_w = (costs.f + ar) / v, (costs.b + ar) / v, costs.w / v
    d_bw = (costs.b + costs.w + max(0.0, ar - costs.w)) / v
    d_min = min(d_f, d_b)
    split = policy.split

    f_end: list[list[float | None]] = [[None] * m for _ in range(S)]
    b_end: list[list[float | None]] = [[None] * m for _ in range(S)]
    next_f, next_b = [0] * S, [0] * S
    wq: list[deque[Pass]] = [deque() for _ in range(P)]
    cur = [0.0] * P
    inflight = [0] * P
    t_free = [0.0] * P
    first_f = [float("inf")] * P
    left = [3 * len(st) * m for st in stages_of]  # F, B, W passes still to run
    actions: list[list[Action]] = [[] for _ in range(P)]
    cap = policy.cap

    def comm(a: int, b: int) -> float:
        return costs.comm if owner[a] != owner[b] else 0.0

    def f_arrival(s: int, i: int) -> float | None:
        if s == 0:
            return 0.0
        e = f_end[s - 1][i]
        return None if e is None else e + comm(s - 1, s)

    def b_arrival(s: int, i: int) -> float | None:
        fe = f_end[s][i]
        if fe is None:
            return None
        if s == S - 1:
            return fe
        be = b_end[s + 1][i]
        return None if be is None else max(fe, be + comm(s + 1, s))

    # v = 2: one chunk forward of headroom lets the oldest microbatch's second
    # forward always fit; v >= 3: reserve every admitted microbatch's forwards.
    reserve = v >= 3
    headroom = f_alloc if v == 2 else 0.0
    res = [0.0] * P

    deep_live = [0] * P  # v = 2: second-chunk activations alive (their B will free memory)
    tight = policy.tight and v == 2

    def admissible(r: int, s: int, extra: float = 0.0) -> bool:
        if s != entry[r]:
            return reserve or cur[r] + extra + f_alloc <= limit + _EPS
        if cap is not None and inflight[r] + (1 if extra else 0) >= cap[r]:
            return False
        need = mem.m_b if reserve else f_alloc + (0.0 if tight and deep_live[r] else headroom)
        return cur[r] + res[r] + extra + need <= limit + _EPS

    heap: list[tuple[float, int, int]] = [(0.0, r, r) for r in range(P)]
    seq = P

    def wake(t: float, r: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, r))

    def finish(r: int, ps: tuple[Pass, ...], start: float, dur: float) -> None:
        """Commit one action: memory, counters, completion times, wake-ups."""
        end = start + dur
        for p in ps:
            if p.kind is Kind.F:
                first_f[r] = min(first_f[r], start)
                cur[r] += f_alloc
                if p.stage == entry[r]:
                    inflight[r] += 1
                    if reserve:
                        res[r] += mem.m_b - f_alloc
                else:
                    deep_live[r] += 1
                    if reserve:
                        res[r] -= f_alloc
        for p in ps:
            s, i = p.stage, p.mb
            left[r] -= 2 if p.kind is Kind.BW else 1
            if p.kind is Kind.F:
                next_f[s] += 1
                f_end[s][i] = end
                if s + 1 < S:
                    wake(end + comm(s, s + 1), owner[s + 1])
            elif p.kind is Kind.W:
                cur[r] -= w_free
            else:
                next_b[s] += 1
                b_end[s][i] = end
                cur[r] -= b_free if p.kind is Kind.B else b_free + w_free
                if p.kind is Kind.B:
                    wq[r].append(Pass(s, Kind.W, i))
                if s == entry[r]:
                    inflight[r] -= 1
                else:
                    deep_live[r] -= 1
                if s > 0:
                    wake(end + comm(s, s - 1), owner[s - 1])
        actions[r].append(ps[0] if len(ps) == 1 else Block(ps))
        t_free[r] = end
        wake(end, r)

    def backward(s: int, i: int) -> Pass:
        return Pass(s, Kind.B if split else Kind.BW, i)

    def take_w(r: int, k: int) -> tuple[Pass, ...]:
        return tuple(wq[r].popleft() for _ in range(k))

    def decide(r: int, g: float) -> None:
        c = t_free[r]
        bs: list[tuple[float, int, int]] = []
        fs: list[tuple[float, int, int]] = []
        future: list[float] = []
        future_b: list[float] = []
        future_f: list[tuple[float, int]] = []
        unknown = False
        blocked = False
        for s in stages_of[r]:
            i = next_b[s]
            if i < m:
                a = b_arrival(s, i)
                if a is None:
                    unknown = True
                elif a <= g + _EPS:
                    bs.append((a, s, i))
                else:
                    future.append(a)
                    future_b.append(a)
            i = next_f[s]
            if i < m:
                a = f_arrival(s, i)
                if a is None:
                    unknown = True
                elif a > g + _EPS:
                    future.append(a)
                    future_f.append((a, s))
                elif admissible(r, s):
                    fs.append((a, s, i))
                else:
                    blocked = True
        bs.sort(key=lambda x: (x[0], -x[1]))
        if policy.deep_first:
            fs.sort(key=lambda x: -x[1])
        else:
            fs.sort(key=lambda x: (x[2], -x[1]))
        nxt = min(future) if future else float("inf")
        if unknown:
            nxt = min(nxt, g + d_min)
        pending = wq[r]

        def w_fits() -> bool:
            return nxt - c >= d_w - _EPS

        if policy.w_now and pending:
            finish(r, take_w(r, 1), c, d_w)
            return

        if policy.braid and fs:
            a, s, i = fs[0]
            fp = Pass(s, Kind.F, i)
            if bs:
                ab, sb, ib = bs[0]
                bk = Kind.B if policy.braid_defer_w else Kind.BW
                bp = Pass(sb, bk, ib)
                dur = (costs.f + costs.b + (0 if bk is Kind.B else costs.w)) / v
                finish(r, (fp, bp), max(c, a, ab), dur)
                return
            if pending and policy.braid_defer_w:
                k = max(1, min(len(pending), round(ar / costs.w) if costs.w > 0 else 1))
                dur = (costs.f + k * costs.w + max(0.0, ar - k * costs.w)) / v
                finish(r, (fp, *take_w(r, k)), max(c, a), dur)
                return
            second = _second_forward(r, s, i, g)
            if second is not None:
                finish(r, (fp, second[0]), max(c, a, second[1]), 2 * costs.f / v)
                return
            finish(r, (fp,), max(c, a), d_f)
            return
        if bs and (policy.prefer_b or not fs):
            a, s, i = bs[0]
            bp = backward(s, i)
            finish(r, (bp,), max(c, a), d_b if bp.kind is Kind.B else d_bw)
            return
        if fs:
            a, s, i = fs[0]
            start = max(c, a)
            # guard: a backward, or a deeper forward, that arrives while this
            # forward would run goes first (its chain is the critical path)
            urgent = future_b + [t for t, s2 in future_f if s2 > s]
            if not (policy.guard_f and urgent and start + d_f > min(urgent) + _EPS):
                finish(r, (Pass(s, Kind.F, i),), start, d_f)
                return
            if not (pending and w_fits()):
                wake(min(urgent), r)
                return
        if pending:
            done_fb = all(next_f[s] >= m and next_b[s] >= m for s in stages_of[r])
            if policy.eager_w or blocked or done_fb or w_fits():
                finish(r, take_w(r, 1), c, d_w)
                return
        if future:
            wake(min(future), r)

    def _second_forward(r: int, s: int, i: int, g: float) -> tuple[Pass, float] | None:
        """A second ready, admissible forward to braid with F(s, i) (F with F)."""
        extra = mem.m_b if reserve else f_alloc
        for s2 in stages_of[r]:
            i2 = i + 1 if s2 == s else next_f[s2]
            if i2 >= m:
                continue
            a = f_arrival(s2, i2)
            if a is None or a > g + _EPS or not admissible(r, s2, extra):
                continue
            if s2 == s + 1 and i2 == i:
                continue  # depends on the first
            return Pass(s2, Kind.F, i2), a
        return None

    while heap:
        g, _, r = heapq.heappop(heap)
        if t_free[r] > g + _EPS or not left[r]:
            continue
        decide(r, g)
    if any(next_f[s] < m or next_b[s] < m for s in range(S)) or any(wq):
        return None  # stuck: should not happen (see module docstring)
    sch = Schedule(
        name=name,
        num_ranks=P,
        num_microbatches=m,
        stage_to_rank=tuple(owner),
        actions=tuple(tuple(a) for a in actions),
        meta={"origin": "greedy", "policy": policy.label()},
    )
    exact = ar == 0 and not any(isinstance(a, Block) for acts in actions for a in acts)
    spans = [t_free[r] - first_f[r] for r in range(P)]
    return Built(sch, max(t_free), max(spans), exact)


def warmup_caps(stage_to_rank: tuple[int, ...], costs: Costs) -> tuple[int, ...]:
    """Per rank, how many chunk forwards fit between its first forward and
    the arrival of its first backward when one microbatch runs alone: the
    in-flight count that keeps the first backward from waiting (ZB-H2's warm-up
    `2(p-s)-1` for one chunk and unit costs, Zero Bubble section 2.2)."""
    owner = stage_to_rank
    S = len(owner)
    P = max(owner) + 1
    v = S // P
    d_f, d_b = (costs.f + costs.ar) / v, (costs.b + costs.ar) / v
    t = 0.0
    f_start = [0.0] * S
    for s in range(S):
        if s and owner[s] != owner[s - 1]:
            t += costs.comm
        f_start[s] = t
        t += d_f
    b_ready = [0.0] * S
    for s in range(S - 1, -1, -1):
        b_ready[s] = t
        t += d_b + (costs.comm if s and owner[s - 1] != owner[s] else 0.0)
    caps = []
    for r in range(P):
        stages = [s for s in range(S) if owner[s] == r]
        t0, first_b = f_start[stages[0]], b_ready[stages[-1]]
        # entries alone until the rank's next chunk has work, then one entry per
        # v chunk forwards
        t1 = min(first_b, f_start[stages[1]]) if v > 1 else first_b
        n = int((t1 - t0) / d_f + 1e-9) + int(max(0.0, first_b - t1) / (v * d_f) + 1e-9)
        caps.append(max(1, n))
    return tuple(caps)
