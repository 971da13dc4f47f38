"""Schedules built by repeating one building block, squeezing and reordering
("Pipeline Parallelism with Controllable Memory", Qi, Wan, Amar, Lin,
NeurIPS 2024, arXiv 2405.15362, sections 3 and 4).

A building block is the set of passes of one microbatch on all ranks, each
at a fixed slot offset (unit slots: every pass, F, B or W of one chunk,
takes one slot). Repeating it every `T` slots gives a timeline whose
steady state is dense when each rank has exactly `T` passes per
microbatch and their offsets are distinct modulo `T`. The paper's key
fact: a rank's peak activation memory is about the block's lifespan on
that rank (the slots from a forward to the backward that frees it, summed
over chunks) divided by `T`; `block_peak` counts it exactly.

The repetition alone wastes time in the warm-up and the cool-down (the
block's slots were laid out for the steady state). `settle` removes that
waste in four steps, the paper's squeeze and the reordering of its
published scheduler, none of which raises the schedule's peak (the largest
over its ranks) above the repeated block's:

1. `squeeze`: each warm-up and cool-down pass, in time order, moves to the
   earliest free slot its dependencies allow; the steady state keeps the
   block's slots.
2. `compact`: every pass as early as its dependencies and the previous
   pass of its rank allow, each rank's order kept (this closes the gaps
   step 1 leaves, and cannot change any peak: memory depends on the order).
3. `settle_cooldown`: without the W, the passes after the last microbatch
   entered the pipeline move to the earliest free slot again; a W is
   assumed to run in every free slot where one is pending, and a move is
   kept only if that estimate of its rank's peak stays within the
   schedule's.
4. `fill_w`: the W go back into the free slots, oldest first, the later
   chunk's first (its B heads the backward), then `compact` again.

Rank 0 of V-Half, p=4, m=6, the slots each step returns (F f: forward of
chunk 0 / 1; B b: backward of chunk 1 / 0; W w: their weight passes; rank 0
ends last, so its length is the makespan in slots):

    repeat     F.....F...f.F.B.fWF.B.fWFbBwfWFbBwfW.bBwfW.bBw.W.b.w...b.w  58
    squeeze    FFFF...fBfWBfWFBbw..........fWFbBwfWBbwWfBWbw..bw...bw      54
    compact    FFFF...fBfWBfWFBbw.fWFbBwfWBbwWfBWbw..bw...bw               45
    settle     FFFF...fBfWBfWFBbWwfBFbWwfBWbw.fBbWbww.bw                   41

Only forwards raise memory and only W (or B) lower it. The peak is held
both when an activation is freed at its B (M_W = 0) and when it is kept
until its W (M_W = M_B), so it holds for any M_W in between.

Dependencies come from `Pass.needs`, the same rule the validator checks;
a pass also stays after the same pass of the previous microbatch, so every
rank runs microbatches in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stp.schedule.ir import Done, Kind, Pass

__all__ = [
    "BuildingBlock",
    "place_w",
    "repeat",
    "block_peak",
    "steady_window",
    "squeeze",
    "compact",
    "settle_cooldown",
    "fill_w",
    "settle",
    "rank_orders",
]

@dataclass(frozen=True)
class BuildingBlock:
    """Slot offsets of one microbatch's passes, repeated every `period` slots.

    `offsets[r]` maps `(stage, kind)` to a slot for every pass rank r runs
    for one microbatch; `stage_to_rank` is the placement.
    """

    stage_to_rank: tuple[int, ...]
    offsets: tuple[Mapping[tuple[int, Kind], int], ...]
    period: int

    def __post_init__(self) -> None:
        for r, offs in enumerate(self.offsets):
            residues = sorted(t % self.period for t in offs.values())
            # Distinct residues: the repeated blocks never put two passes in one slot.
            assert len(set(residues)) == len(residues) <= self.period, (r, dict(offs))
            for (s, _), _t in offs.items():
                assert self.stage_to_rank[s] == r, (s, r)

    @property
    def num_ranks(self) -> int:
        return len(self.offsets)


def place_w(
    backward_offsets: Mapping[tuple[int, Kind], int],
    taken: Sequence[int],
    period: int,
) -> dict[tuple[int, Kind], int]:
    """Offsets of the W passes of one rank, one per B in `backward_offsets`
    (keyed `(stage, Kind.B)`), on the residues mod `period` that `taken`
    leaves free.

    Each W goes to the first free slot after its B; of the ways to give each
    W its own residue, the one with the shortest total B-to-W wait wins (a W
    keeps `M_W` alive until it runs), ties to the earliest last W.
    """
    free = [res for res in range(period) if res not in {t % period for t in taken}]
    bs = sorted(backward_offsets.items(), key=lambda kv: kv[1])
    assert len(free) >= len(bs), (free, bs)

    def first_after(t: int, res: int) -> int:
        return t + 1 + (res - t - 1) % period

    best: tuple[tuple[int, int], dict[tuple[int, Kind], int]] | None = None
    for choice in _assignments(free, len(bs)):
        ws = {(s, Kind.W): first_after(t, res) for ((s, _), t), res in zip(bs, choice, strict=True)}
        key = (sum(ws.values()) - sum(t for _, t in bs), max(ws.values(), default=0))
        if best is None or key < best[0]:
            best = (key, ws)
    assert best is not None
    return best[1]


def _assignments(free: list[int], n: int) -> list[tuple[int, ...]]:
    """All ordered choices of n distinct residues out of `free`."""
    if n == 0:
        return [()]
    return [
        (res,) + rest
        for i, res in enumerate(free)
        for rest in _assignments(free[:i] + free[i + 1 :], n - 1)
    ]


def repeat(block: BuildingBlock, num_microbatches: int) -> dict[Pass, int]:
    """The slot of every pass when microbatch k's block starts at `k * period`."""
    return {
        Pass(s, kind, k): t + k * block.period
        for offs in block.offsets
        for (s, kind), t in offs.items()
        for k in range(num_microbatches)
    }


def _release(p: Pass, upto: Kind) -> Pass:
    """The pass that frees forward `p`'s activation: its B, or its W."""
    return Pass(p.stage, upto, p.mb)


def _live_counts(
    slots: Mapping[Pass, int], rank_passes: Sequence[Pass], upto: Kind, horizon: int
) -> list[int]:
    """Activations alive in each slot (a forward's from its slot through the
    slot of the pass that frees it, the order-based count of `peak_by_order`)."""
    live = [0] * horizon
    for p in rank_passes:
        if p.kind is Kind.F:
            for t in range(slots[p], slots[_release(p, upto)] + 1):
                live[t] += 1
    return live


def block_peak(block: BuildingBlock, rank: int, upto: Kind) -> int:
    """Peak number of chunk activations alive on `rank` in the steady state of
    the repeated block (freed at `upto`: Kind.B or Kind.W). This is the
    lifespan / period of the paper, counted slot by slot."""
    offs = block.offsets[rank]
    spans = [(t, offs[(s, upto)]) for (s, kind), t in offs.items() if kind is Kind.F]
    T = block.period
    base = max(end for _, end in spans) + T  # late enough that every k >= 0
    # Intervals [a + kT, e + kT] contain u for ceil((u-e)/T) <= k <= floor((u-a)/T).
    return max(
        sum((u - a) // T + (e - u) // T + 1 for a, e in spans)
        for u in range(base, base + T)
    )


def steady_window(block: BuildingBlock, num_microbatches: int) -> tuple[int, int]:
    """Slots (first, last) where every rank runs the repeated block's steady
    state: after microbatch 0's block has ended (its last pass, on any rank)
    and up to the start of the last microbatch's block. Empty (first > last)
    when m is too small to have one."""
    length = max(t for offs in block.offsets for t in offs.values()) + 1
    return length, (num_microbatches - 1) * block.period


def squeeze(block: BuildingBlock, num_microbatches: int) -> dict[Pass, int]:
    """Repeat `block` and move every warm-up and cool-down pass as early as
    its dependencies and a free slot allow without raising any rank's peak
    (see the module docstring).

    Passes are taken in slot order, so when a pass moves, everything it
    depends on has already found its final slot; a pass only moves earlier,
    so a slot it takes is never wanted by a pass still to come.

    The steady state, slots `steady_window`, keeps the block's exact order,
    as the paper's squeeze does: there every slot is taken anyway, and a
    free slot left by the warm-up could otherwise let moves ripple through
    it, giving an order that is as dense with unit passes but no longer the
    block's, and slower than it when T_F, T_B, T_W differ.
    """
    slots = repeat(block, num_microbatches)
    lo, hi = steady_window(block, num_microbatches)
    num_stages = len(block.stage_to_rank)
    horizon = max(slots.values()) + 1
    by_rank: list[list[Pass]] = [[] for _ in block.offsets]
    for p in slots:
        by_rank[block.stage_to_rank[p.stage]].append(p)
    budget = {
        upto: [block_peak(block, r, upto) for r in range(block.num_ranks)]
        for upto in (Kind.B, Kind.W)
    }
    live = {
        upto: [_live_counts(slots, ps, upto, horizon) for ps in by_rank]
        for upto in (Kind.B, Kind.W)
    }
    taken: list[set[int]] = [set() for _ in block.offsets]
    for p in sorted(slots, key=lambda q: (slots[q], block.stage_to_rank[q.stage])):
        r = block.stage_to_rank[p.stage]
        old = slots[p]
        if lo <= old <= hi:
            taken[r].add(old)
            continue
        earliest = _earliest(p, slots, num_stages)
        for t in range(earliest, old):
            if t in taken[r] or not _fits(p, t, old, live, budget, r):
                continue
            _move(p, t, old, live, r)
            slots[p] = t
            break
        taken[r].add(slots[p])
    return slots


def _fits(
    p: Pass, t: int, old: int, live: dict[Kind, list[list[int]]],
    budget: dict[Kind, list[int]], r: int,
) -> bool:
    """Moving forward p from `old` to `t` keeps one more activation alive in
    slots t..old-1; backwards and W moving earlier only free memory sooner."""
    if p.kind is not Kind.F:
        return True
    return all(max(live[upto][r][t:old]) + 1 <= budget[upto][r] for upto in live)


def _move(p: Pass, t: int, old: int, live: dict[Kind, list[list[int]]], r: int) -> None:
    if p.kind is Kind.F:
        for upto in live:
            for u in range(t, old):
                live[upto][r][u] += 1
    elif p.kind in live:  # a B (or W) frees its activation in slot t instead of old
        for u in range(t + 1, old + 1):
            live[p.kind][r][u] -= 1


def _earliest(p: Pass, slots: Mapping[Pass, int], num_stages: int) -> int:
    """First slot p may take: after its inputs and after the same pass of the
    previous microbatch."""
    after = [slots[Pass(d.stage, d.kind, d.mb)] for d in p.needs(num_stages)]
    if p.mb > 0:
        after.append(slots[Pass(p.stage, p.kind, p.mb - 1)])
    return max(after, default=-1) + 1


def compact(slots: Mapping[Pass, int], stage_to_rank: Sequence[int]) -> dict[Pass, int]:
    """Every pass as early as its inputs and the previous pass of its rank
    allow, each rank's order kept. Passes are taken in slot order, so a
    pass's inputs (earlier slots in a valid timeline) are placed first."""
    num_stages = len(stage_to_rank)
    free = [0] * (max(stage_to_rank) + 1)
    out: dict[Pass, int] = {}
    ready: dict[Done, int] = {}  # the slot after each result's pass
    for p in sorted(slots, key=lambda q: (slots[q], stage_to_rank[q.stage])):
        r = stage_to_rank[p.stage]
        t = max([free[r]] + [ready[d] for d in p.needs(num_stages)])
        out[p] = t
        free[r] = t + 1
        for d in p.completes():
            ready[d] = t + 1
    return out


def _peaks_without_w(rank_slots: Mapping[Pass, int]) -> tuple[int, int]:
    """(peak freed at B, peak freed at W) in chunk activations of one rank's
    passes without their W, a pending W assumed to run in each free slot
    (peaks rise only at a forward, so only the passes' slots are visited)."""
    live_b = live_w = peak_b = peak_w = pending = 0
    last = -1
    for t, forward in sorted((t, q.kind is Kind.F) for q, t in rank_slots.items()):
        ran = min(pending, t - last - 1)  # W run in the free slots since the last pass
        pending -= ran
        live_w -= ran
        if forward:
            live_b += 1
            live_w += 1
            peak_b, peak_w = max(peak_b, live_b), max(peak_w, live_w)
        else:
            live_b -= 1
            pending += 1
        last = t
    return peak_b, peak_w


def settle_cooldown(
    slots: Mapping[Pass, int], stage_to_rank: Sequence[int], after: int
) -> dict[Pass, int]:
    """Drop the W and move every pass after slot `after` to the earliest
    free slot its inputs allow, unless that raises its rank's peak (counted
    by `_peaks_without_w`) above the schedule's."""
    num_stages = len(stage_to_rank)
    out = {q: t for q, t in slots.items() if q.kind is not Kind.W}
    ranks: list[dict[Pass, int]] = [{} for _ in range(max(stage_to_rank) + 1)]
    for q, t in out.items():
        ranks[stage_to_rank[q.stage]][q] = t
    budget = [max(v) for v in zip(*map(_peaks_without_w, ranks), strict=True)]
    taken = [set(rs.values()) for rs in ranks]
    for p in sorted(out, key=lambda q: (out[q], stage_to_rank[q.stage])):
        old = out[p]
        if old <= after:
            continue
        r = stage_to_rank[p.stage]
        for t in range(_earliest(p, out, num_stages), old):
            if t in taken[r]:
                continue
            ranks[r][p] = t
            if all(got <= cap for got, cap in zip(_peaks_without_w(ranks[r]), budget,
                                                  strict=True)):
                taken[r].discard(old)
                taken[r].add(t)
                out[p] = t
                break
            ranks[r][p] = old
    return out


def fill_w(slots: Mapping[Pass, int], stage_to_rank: Sequence[int]) -> dict[Pass, int]:
    """Put every W into the first free slot of its rank after its B, oldest
    first, the higher stage's (the later chunk, first on the backward's way)
    before the lower's; the W left at the end follow the rank's last pass."""
    out = {q: t for q, t in slots.items() if q.kind is not Kind.W}
    for r in range(max(stage_to_rank) + 1):
        mine = {t: q for q, t in out.items() if stage_to_rank[q.stage] == r}
        queues: dict[int, list[Pass]] = {}
        t = 0
        end = max(mine, default=-1)
        while t <= end or any(queues.values()):
            q = mine.get(t)
            if q is not None and q.kind is Kind.B:
                queues.setdefault(q.stage, []).append(Pass(q.stage, Kind.W, q.mb))
            elif q is None:
                ready = [s for s in sorted(queues, reverse=True) if queues[s]]
                if ready:
                    out[queues[ready[0]].pop(0)] = t
            t += 1
    return out


def settle(block: BuildingBlock, num_microbatches: int) -> dict[Pass, int]:
    """The slots of every pass after the four steps of the module docstring."""
    owner = block.stage_to_rank
    slots = compact(squeeze(block, num_microbatches), owner)
    first = min(s for s in range(len(owner)) if owner[s] == 0)
    last_entry = slots[Pass(first, Kind.F, num_microbatches - 1)]
    slots = settle_cooldown(slots, owner, last_entry)
    return compact(fill_w(slots, owner), owner)


def rank_orders(slots: Mapping[Pass, int], stage_to_rank: Sequence[int]) -> list[list[Pass]]:
    """Each rank's passes in slot order: the action lists of the schedule."""
    orders: list[list[Pass]] = [[] for _ in range(max(stage_to_rank) + 1)]
    for p in sorted(slots, key=slots.__getitem__):
        orders[stage_to_rank[p.stage]].append(p)
    return orders
