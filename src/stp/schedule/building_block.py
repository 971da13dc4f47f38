"""Schedules built by repeating one building block, then squeezing
(Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024,
seed 003, section 3).

A building block is the set of passes of one microbatch on all ranks, each
at a fixed slot offset (unit slots: every pass, F, B or W of one chunk,
takes one slot). Repeating it every `T` slots gives a timeline whose
steady state is dense when each rank has exactly `T` passes per
microbatch and their offsets are distinct modulo `T`. The paper's key
fact: a rank's peak activation memory is about the block's lifespan on
that rank (the slots from a forward to the backward that frees it, summed
over chunks) divided by `T`; `block_peak` counts it exactly.

The repetition alone wastes time in the warm-up and the cool-down (the
block's slots were laid out for the steady state). `squeeze` moves each
warm-up and cool-down pass, in time order, to the earliest free slot its
dependencies allow, unless that would raise the rank's peak above the
repeated block's; the steady state keeps the block's order. Rank 0 of
V-Half, p=4, m=6, as the simulator runs it with unit passes (F f: forward
of chunk 0 / 1; B b: backward of chunk 1 / 0; W w: their weight passes):

    repeated   FF.....fFB.fWFB.fWFbBwfWFbBwfW.bBwfW    (bubble 12, makespan 48)
    squeezed   FFFF...fBfWBfWFBbw.fWFbBwfWBbwWfBWbw    (bubble  9, makespan 45)

Only forwards can raise memory, so only their moves are checked. The peak
is held both when an activation is freed at its B (M_W = 0) and when it is
kept until its W (M_W = M_B), so it holds for any M_W in between.

Dependencies come from `stp.schedule.validate.dependencies`, the same rule
the validator checks; a pass also stays after the same pass of the previous
microbatch, so every rank runs microbatches in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stp.schedule.ir import Kind, Pass
from stp.schedule.validate import dependencies

__all__ = [
    "BuildingBlock",
    "place_w",
    "repeat",
    "block_peak",
    "steady_window",
    "squeeze",
    "rank_orders",
]

_KIND = {"F": Kind.F, "B": Kind.B, "W": Kind.W}


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
        earliest = max(
            [slots[Pass(s, _KIND[k], i)] + 1 for s, k, i in dependencies(p, num_stages)]
            + ([slots[Pass(p.stage, p.kind, p.mb - 1)] + 1] if p.mb > 0 else [0])
        )
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


def rank_orders(slots: Mapping[Pass, int], stage_to_rank: Sequence[int]) -> list[list[Pass]]:
    """Each rank's passes in slot order: the action lists of the schedule."""
    orders: list[list[Pass]] = [[] for _ in range(max(stage_to_rank) + 1)]
    for p in sorted(slots, key=slots.__getitem__):
        orders[stage_to_rank[p.stage]].append(p)
    return orders
