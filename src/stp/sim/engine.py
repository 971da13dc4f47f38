"""Discrete-event simulation of a schedule: compute, TP all-reduce, sends, memory.

Model (one rank; every rank of a TP group does the same, so one stands for all):

* compute lane: runs the rank's actions in list order, each action's units in
  `braid()` order, one unit at a time.
* TP lane: each F or B unit ends in an all-reduce of `ar / v / U` (its share
  of one pass's all-reduce time); all-reduces run one at a time, in issue
  order. The next F/B unit of the same pass waits for it (its input is the
  reduced tensor).
* A pass on its own waits for each of its all-reduces, as plain TP code does,
  including the last one before the action ends. In a braided block all
  all-reduces are asynchronous: the stream waits only where a unit needs a
  result, so the block's last all-reduce may run under the next action.
  In a full backward the W unit needs only its B unit's input, not its
  all-reduce, so `AR(B_u)` runs under `W_u`. Nothing else overlaps: these
  rules alone give the TP column of the STP table (REFERENCE section 3).
* sends: a pass's output leaves when its last all-reduce ends and arrives
  `comm` later on another rank; same-rank hand-offs (the V tip) are free.
* memory: an action allocates its forwards' activations when it starts and
  releases its backwards' when it ends (`stp.schedule.memory`).
* offload (optional `OffloadPlan`): an offloaded forward's activations are
  copied out on the rank's device-to-host lane right after the forward and
  stop counting when that copy ends; the copy back runs on the host-to-device
  lane from when the stream reaches the plan's reload position (and the copy
  out has ended) and counts from its start; the backward waits for it.

Accounting per rank: `exposed_tp` is compute-lane time spent waiting on an
all-reduce beyond any wait for pipeline data; `idle` (the PP bubble) is the
rest of the span not spent computing.
"""

from __future__ import annotations

from stp.schedule.ir import Kind, Pass, Schedule, passes_of
from stp.schedule.memory import MemCosts, action_memory
from stp.schedule.offload import OffloadPlan
from stp.schedule.validate import ScheduleError, dependencies
from stp.sim.costs import Costs, OffloadCosts
from stp.sim.result import RankStats, SimResult, Span
from stp.sim.units import braid

__all__ = ["simulate"]

_DONE_KEYS = {Kind.F: ("F",), Kind.B: ("B",), Kind.W: ("W",), Kind.BW: ("B", "W")}


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    mem: MemCosts | None = None,
    layers: int = 1,
    *,
    offload: OffloadPlan | None = None,
    offload_costs: OffloadCosts | None = None,
    record_spans: bool = True,
) -> SimResult:
    """Simulate `schedule` under `costs` (per microbatch, per rank share).

    The schedule must be valid (`stp.schedule.validate`); a deadlock is still
    detected and raised as ScheduleError. `layers` is transformer layers per
    chunk: each pass is `2 * layers` units.
    """
    costs = costs or Costs()
    mem = mem or MemCosts()
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r} must be an integer >= 1")
    S, P, v = schedule.num_stages, schedule.num_ranks, schedule.chunks
    U = 2 * layers
    unit_time = {"F": costs.f / v / U, "B": costs.b / v / U, "W": costs.w / v / U}
    ar_u = costs.ar / v / U
    owner = schedule.stage_to_rank
    chunk_of = [schedule.chunk_of(s) for s in range(S)]

    done: dict[tuple[int, str, int], float] = {}  # (stage, F/B/W, mb) -> output ready
    lane = [0.0] * P  # compute lane free
    tp = [0.0] * P  # TP lane free
    first_f = [float("inf")] * P
    last_end = [0.0] * P
    busy = [0.0] * P
    tp_wait = [0.0] * P
    mem_events: list[list[tuple[float, float]]] = [[] for _ in range(P)]
    off_wait = [0.0] * P
    plan = offload.reload_at if offload else {}
    oc = offload_costs or OffloadCosts()
    chunk_bytes_time = oc.copy_time(mem.m_b / v)  # one chunk activation, one way
    d2h = [0.0] * P
    h2d = [0.0] * P
    copied_out: dict[tuple[int, int], float] = {}
    reload_ready: dict[tuple[int, int], float] = {}
    reloads_at: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(P)]
    for key, pos in plan.items():
        reloads_at[owner[key[0]]].setdefault(pos, []).append(key)
    spans: list[Span] = []
    ptr = [0] * P
    acts = schedule.actions

    def input_ready(p: Pass, rank: int) -> float | None:
        t = 0.0
        for d in dependencies(p, S):
            got = done.get(d)
            if got is None:
                return None
            if owner[d[0]] != rank:
                got += costs.comm
            t = max(t, got)
        return t

    progress = True
    while progress:
        progress = False
        for r in range(P):
            while ptr[r] < len(acts[r]):
                action = acts[r][ptr[r]]
                ps = passes_of(action)
                ready = [input_ready(p, r) for p in ps]
                if any(t is None for t in ready):
                    break
                idx = ptr[r]
                ptr[r] += 1
                progress = True
                braided = len(ps) > 1
                t = lane[r]
                for key in sorted(reloads_at[r].get(idx, ())):
                    # reload issued when the stream reaches this action
                    a0 = max(t, h2d[r], copied_out[key])
                    h2d[r] = a0 + chunk_bytes_time
                    reload_ready[key] = h2d[r]
                    mem_events[r].append((a0, mem.m_b / v))
                    if record_spans:
                        spans.append(Span(r, "h2d", a0, h2d[r], f"{key[0]}RELOAD{key[1]}",
                                          "H2D", key[0], key[1], chunk_of[key[0]], None, idx))
                start = None
                chain_ar = [0.0] * len(ps)  # end of the chain's last all-reduce
                chain_end = [0.0] * len(ps)
                for it in braid(action, U):
                    p = ps[it.chain]
                    dep = ready[it.chain] if it.first else 0.0
                    base = max(t, dep)  # type: ignore[arg-type]
                    if it.first and p.kind is not Kind.F and (p.stage, p.mb) in reload_ready:
                        back = max(base, reload_ready.pop((p.stage, p.mb)))
                        off_wait[r] += back - base
                        base = back
                    s = max(base, chain_ar[it.chain]) if it.waits_ar else base
                    tp_wait[r] += s - base
                    if start is None:
                        start = s
                        alloc, _ = action_memory(action, v, mem)
                        if alloc:
                            mem_events[r].append((s, alloc))
                    if p.kind is Kind.F:
                        first_f[r] = min(first_f[r], s)
                    e = s + unit_time[it.kind]
                    busy[r] += e - s
                    if record_spans:
                        spans.append(
                            Span(r, "compute", s, e, str(p), it.kind, p.stage, p.mb,
                                 chunk_of[p.stage], it.unit, idx, braided)
                        )
                    if it.has_ar and ar_u > 0:
                        a0 = max(e, tp[r])
                        tp[r] = a0 + ar_u
                        chain_ar[it.chain] = tp[r]
                        if record_spans:
                            spans.append(
                                Span(r, "tp", a0, tp[r], str(p), "AR", p.stage, p.mb,
                                     chunk_of[p.stage], it.unit, idx, braided)
                            )
                    elif it.has_ar:
                        chain_ar[it.chain] = e
                    chain_end[it.chain] = max(e, chain_ar[it.chain])
                    t = e
                if not braided:
                    # plain TP code: the pass's last all-reduce is synchronous
                    end = max(t, chain_ar[0])
                    tp_wait[r] += end - t
                    t = end
                lane[r] = t
                _, free = action_memory(action, v, mem)
                if free:
                    mem_events[r].append((t, -free))
                for c, p in enumerate(ps):
                    fin = chain_end[c]
                    if p.kind is Kind.F and (p.stage, p.mb) in plan:
                        a0 = max(fin, d2h[r])
                        d2h[r] = a0 + chunk_bytes_time
                        copied_out[(p.stage, p.mb)] = d2h[r]
                        mem_events[r].append((d2h[r], -mem.m_b / v))
                        if record_spans:
                            spans.append(Span(r, "d2h", a0, d2h[r], f"{p.stage}OFFLOAD{p.mb}",
                                              "D2H", p.stage, p.mb, chunk_of[p.stage], None,
                                              idx))
                    last_end[r] = max(last_end[r], fin)
                    for k in _DONE_KEYS[p.kind]:
                        done[(p.stage, k, p.mb)] = fin
                    if record_spans and costs.comm > 0 and p.kind is not Kind.W:
                        nxt = p.stage + 1 if p.kind is Kind.F else p.stage - 1
                        if 0 <= nxt < S and owner[nxt] != r:
                            spans.append(
                                Span(r, "send", fin, fin + costs.comm, str(p), "SEND",
                                     p.stage, p.mb, chunk_of[p.stage], None, idx, braided)
                            )

    stuck = [r for r in range(P) if ptr[r] < len(acts[r])]
    if stuck:
        r = stuck[0]
        raise ScheduleError(
            "deadlock in simulation (validate the schedule for a diagnosis)",
            r, ptr[r], acts[r][ptr[r]],
        )
    memory, peak = _memory_curves(mem_events)
    ranks = [
        RankStats(
            rank=r,
            start=first_f[r] if first_f[r] != float("inf") else 0.0,
            end=last_end[r],
            compute=busy[r],
            exposed_tp=tp_wait[r],
            peak_activation=peak[r],
            exposed_offload=off_wait[r],
        )
        for r in range(P)
    ]
    return SimResult(
        schedule=schedule,
        costs=costs,
        mem=mem,
        layers=layers,
        makespan=max(last_end) if last_end else 0.0,
        ranks=ranks,
        spans=spans,
        memory=memory,
        offload=offload,
    )


def _memory_curves(
    events: list[list[tuple[float, float]]],
) -> tuple[list[list[tuple[float, float]]], list[float]]:
    """Sweep each rank's (time, delta) events in time order, frees first at
    equal times (so an action that starts as another ends does not count
    both), into step curves and peaks."""
    curves, peaks = [], []
    for ev in events:
        ev.sort(key=lambda e: (e[0], e[1] > 0))
        cur = peak = 0.0
        curve = [(0.0, 0.0)]
        for t, d in ev:
            cur += d
            peak = max(peak, cur)
            if curve[-1][0] == t:
                curve[-1] = (t, cur)
            else:
                curve.append((t, cur))
        curves.append(curve)
        peaks.append(peak)
    return curves, peaks
