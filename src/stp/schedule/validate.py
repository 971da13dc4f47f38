"""Schedule validation: completeness, placement, dependencies, deadlock, memory.

Point-to-point semantics assumed (the runtime's): sends are non-blocking
(`isend`, completed in the background, never wait for the receiver's
program position) and every receive is posted as early as the rank likes; a
rank blocks only when an action needs data that has not arrived. Under these
semantics a schedule is deadlock-free exactly when the graph of per-rank
program order plus data dependencies has no cycle, which the token game
below decides: every rank runs its next action as soon as the data it needs
exists; if no rank can move before all are done, the ranks' head actions
and what each waits for are the diagnosis.

Dependencies ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241,
section 2), as `Pass.needs` states them:
  F(s, i)      after F(s-1, i)
  B/BW(s, i)   after F(s, i) and after B/BW(s+1, i)
  W(s, i)      after B(s, i)
The passes of one braided block run interleaved, so none may depend on
another pass of the same block.
"""

from __future__ import annotations

from stp.schedule.ir import Action, Done, Kind, Pass, Schedule, passes_of
from stp.schedule.memory import MemCosts, action_memory

__all__ = ["ScheduleError", "validate", "dependencies"]


class ScheduleError(ValueError):
    """A schedule is invalid. `rank`/`position`/`action` locate the fault."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        position: int | None = None,
        action: Action | None = None,
    ) -> None:
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if position is not None:
                where += f", position {position}"
            if action is not None:
                where += f" ({action})"
            where += ": "
        super().__init__(where + message)
        self.rank, self.position, self.action = rank, position, action


def dependencies(p: Pass, num_stages: int) -> list[tuple[int, str, int]]:
    """(stage, kind, mb) the pass waits for; kind in F/B/W, B meaning B or BW.

    The letter-keyed form of `Pass.needs` for callers that key results by
    "F"/"B"/"W"; new code should use `Pass.needs` and `Pass.completes`."""
    return [(d.stage, d.kind.label, d.mb) for d in p.needs(num_stages)]


def _check_counts(sch: Schedule) -> None:
    S, m = sch.num_stages, sch.num_microbatches
    seen: dict[Done, tuple[int, int]] = {}
    for r, acts in enumerate(sch.actions):
        for pos, a in enumerate(acts):
            for p in passes_of(a):
                if not 0 <= p.stage < S:
                    raise ScheduleError(
                        f"stage {p.stage} outside 0..{S - 1}", r, pos, a
                    )
                if sch.stage_to_rank[p.stage] != r:
                    raise ScheduleError(
                        f"stage {p.stage} is placed on rank {sch.stage_to_rank[p.stage]}, "
                        f"not on rank {r}", r, pos, a,
                    )
                if not 0 <= p.mb < m:
                    raise ScheduleError(f"microbatch {p.mb} outside 0..{m - 1}", r, pos, a)
                for key in p.completes():
                    if key in seen:
                        r0, pos0 = seen[key]
                        raise ScheduleError(
                            f"{key} already runs at rank {r0}, position {pos0}", r, pos, a,
                        )
                    seen[key] = (r, pos)
    for s in range(S):
        for i in range(m):
            for k in (Kind.F, Kind.B, Kind.W):
                if Done(s, k, i) not in seen:
                    raise ScheduleError(
                        f"{Done(s, k, i)} never runs on rank {sch.stage_to_rank[s]}",
                        sch.stage_to_rank[s],
                    )


def _check_blocks(sch: Schedule) -> None:
    for r, acts in enumerate(sch.actions):
        for pos, a in enumerate(acts):
            ps = passes_of(a)
            if len(ps) < 2:
                continue
            provided = {key for p in ps for key in p.completes()}
            for p in ps:
                for d in p.needs(sch.num_stages):
                    if d in provided:
                        raise ScheduleError(
                            f"{p} depends on {d} inside the same braided block; "
                            "braided passes must be independent", r, pos, a,
                        )


def _check_deadlock(sch: Schedule) -> None:
    S = sch.num_stages
    done: set[Done] = set()
    ptr = [0] * sch.num_ranks
    n = [len(a) for a in sch.actions]
    progress = True
    while progress:
        progress = False
        for r in range(sch.num_ranks):
            acts = sch.actions[r]
            while ptr[r] < n[r]:
                a = acts[ptr[r]]
                if any(d not in done for p in passes_of(a) for d in p.needs(S)):
                    break
                for p in passes_of(a):
                    done.update(p.completes())
                ptr[r] += 1
                progress = True
    if all(ptr[r] == n[r] for r in range(sch.num_ranks)):
        return
    lines = []
    first: tuple[int, int, Action] | None = None
    for r in range(sch.num_ranks):
        if ptr[r] == n[r]:
            continue
        a = sch.actions[r][ptr[r]]
        missing = [d for p in passes_of(a) for d in p.needs(S) if d not in done]
        d = missing[0]
        holder = sch.stage_to_rank[d.stage]
        if holder == r:
            raise ScheduleError(
                f"waits for {d}, which this rank runs only later (or never)", r, ptr[r], a,
            )
        lines.append(f"rank {r} position {ptr[r]} ({a}) waits for {d} from rank {holder}")
        if first is None:
            first = (r, ptr[r], a)
    assert first is not None
    raise ScheduleError("deadlock: " + "; ".join(lines), *first)


def _check_memory(sch: Schedule, limit: float, mem: MemCosts) -> None:
    v = sch.chunks
    for r, acts in enumerate(sch.actions):
        cur = 0.0
        for pos, a in enumerate(acts):
            alloc, free = action_memory(a, v, mem)
            cur += alloc
            if cur > limit + 1e-9:
                raise ScheduleError(
                    f"activation memory {cur:g} exceeds the limit {limit:g}", r, pos, a
                )
            cur -= free


def validate(
    schedule: Schedule,
    *,
    memory_limit: float | None = None,
    mem: MemCosts | None = None,
) -> None:
    """Raise ScheduleError (a ValueError) naming rank, position and action if
    `schedule` is incomplete, misplaced, out of dependency order, deadlocks, or
    holds more than `memory_limit` activations (units of `M_B`)."""
    _check_counts(schedule)
    _check_blocks(schedule)
    _check_deadlock(schedule)
    if memory_limit is not None:
        _check_memory(schedule, memory_limit, mem or MemCosts())
