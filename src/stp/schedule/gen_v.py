"""V-shape schedules with split backward: ZB-V, V-Half, V-Min.

All three use the V placement (`v_placement`): rank r holds stage r (its
chunk 0) and stage 2p-1-r (its chunk 1), so a microbatch runs down the ranks
and back up, the hand-off between stages p-1 and p stays on rank p-1, and
the loss is on rank 0. The backward is split into B (input gradient) and W
(weight gradient), as in "Zero Bubble Pipeline Parallelism" (Qi, Wan, Huang,
Lin, ICLR 2024, arXiv 2401.10241).

Memory is counted in M_B, one microbatch through a rank's whole share, so a
forward of one chunk adds M_B / 2 (`stp.schedule.memory`). Bubbles below
are in unit slots: every chunk pass (F, B or W of one chunk) takes one
slot, the papers' T_F = T_B = T_W; 1F1B's bubble is then
(p-1)(T_F+T_B+T_W) = 6(p-1) slots.

* ZB-V (Zero Bubble, section 6): a per-rank rule, zero bubble and 1F1B's
  peak `p M_B` on every rank.
* V-Half, V-Min ("Pipeline Parallelism with Controllable Memory", Qi, Wan,
  Amar, Lin, NeurIPS 2024, arXiv 2405.15362): one building block repeated
  every 6 slots, squeezed and reordered (`stp.schedule.building_block`), at
  about 1/2 and 1/3 of 1F1B's memory. A V-shape block whose peak is `l`
  chunk activations (`l M_B / 2`, counted until the W) leaves, once
  squeezed, a bubble of `6p - 1 - 3l` slots on its longest rank (the count
  the paper's published scheduler expects, for `l <= 2p - 2`; ZB-V's
  `l = 2p` has none).
"""

from __future__ import annotations

from stp.schedule.building_block import BuildingBlock, block_peak, place_w, rank_orders, settle
from stp.schedule.gen_classic import check_sizes
from stp.schedule.ir import Kind, Pass, Schedule, drop_microbatches, v_placement, v_schedule

__all__ = [
    "zb_v",
    "v_half",
    "v_min",
    "zero_bubble_min_microbatches",
    "v_min_offsets",
    "v_half_offsets",
    "controllable_memory_block",
    "from_offsets",
]


# -- ZB-V ---------------------------------------------------------------------


def zero_bubble_min_microbatches(num_ranks: int) -> int:
    """Smallest m at which ZB-V runs its full rule: rank 0's warm-up alone
    needs 2p-1 distinct microbatches."""
    return 2 * num_ranks - 1


def _zb_v_rank(p: int, n: int, r: int) -> list[Pass]:
    """ZB-V order of rank r for n >= 2p-1 microbatches (the rule of `zb_v`)."""
    assert n >= zero_bubble_min_microbatches(p)
    s0, s1 = r, 2 * p - 1 - r  # chunk 0 and chunk 1 of rank r
    nxt = {(s, k): 0 for s in (s0, s1) for k in (Kind.F, Kind.B, Kind.W)}
    order: list[Pass] = []

    def run(stage: int, kind: Kind) -> None:
        order.append(Pass(stage, kind, nxt[(stage, kind)]))
        nxt[(stage, kind)] += 1

    def group(stage: int) -> None:  # one F-B-W group; the F only while any is left
        if nxt[(stage, Kind.F)] < n:
            run(stage, Kind.F)
        run(stage, Kind.B)
        run(stage, Kind.W)

    # Warm-up, 2p-1 forwards: chunk 0 until chunk 1's first input arrives
    # (it went down p-1-r ranks and back up), then chunk 1 and chunk 0 take turns.
    for _ in range(2 * (p - r) - 1):
        run(s0, Kind.F)
    for _ in range(r):
        run(s1, Kind.F)
        run(s0, Kind.F)
    # Steady: p-r groups of chunk 1 (p-i for 1-indexed i, plus the first of the
    # alternation), then chunk 0 and chunk 1 alternate until every F has run.
    for _ in range(p - r):
        group(s1)
    while nxt[(s0, Kind.F)] < n or nxt[(s1, Kind.F)] < n:
        group(s0)
        group(s1)
    # Cool-down: backwards first; the W of the last p-r chunk-0 B fill the gaps
    # while the next B0 comes up the pipe; the other W close the rank.
    for _ in range(r):
        run(s0, Kind.B)
        run(s1, Kind.B)
    for _ in range(p - r):
        run(s0, Kind.B)
        run(s0, Kind.W)
    for s in (s1, s0):
        while nxt[(s, Kind.W)] < n:
            run(s, Kind.W)
    assert all(v == n for v in nxt.values()), nxt
    return order


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv
    2401.10241, section 6; PyTorch's `ScheduleZBVZeroBubble` follows the same rule).

    Rank r (worker i = r+1 of the paper):

    * warm-up, 2p-1 forwards: 2p-i of chunk 0 and i-1 of chunk 1
      (`2(p-r)-1` chunk-0 forwards, then r pairs chunk 1, chunk 0);
    * steady: F-B-W groups, p-i of chunk 1 first, then chunk 1 and chunk 0
      alternate (a group has no F once that chunk's forwards are done);
    * cool-down: the remaining B first, r pairs (B0, B1), then p-r times
      (B0, W) with the W filling the wait for the next B0; then the other W,
      chunk 1's before chunk 0's.

    With T_F = T_B = T_W the bubble is zero: every rank is busy from its
    first F to its last W (span = m(T_F+T_B+T_W)); rank r starts r chunk
    forwards after rank 0, so the makespan is that plus (p-1) T_F / 2.
    Peak activation `p M_B` (2p chunk forwards in flight) on every rank,
    the same as 1F1B's rank 0.

    Accepted for every m >= 1: the rule needs m >= 2p-1
    (`zero_bubble_min_microbatches`); for fewer it is built for 2p-1 and the
    passes of the missing microbatches are dropped, which keeps the order
    valid (it only removes passes) but not bubble-free, and the peak is then
    lower than p.
    """
    check_sizes("zb-v", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    n = max(m, zero_bubble_min_microbatches(p))
    actions = [drop_microbatches(_zb_v_rank(p, n, r), m) for r in range(p)]
    return v_schedule("zb-v", m, actions, placement="v",
                      zero_bubble_min_microbatches=zero_bubble_min_microbatches(p),
                      truncated_from=n if n > m else None)


# -- controllable-memory building blocks (V-Half, V-Min) ----------------------

PERIOD = 6
"""Slots per microbatch per rank: F, f, B, b, W, w, one slot each."""


def v_min_offsets(num_ranks: int) -> list[tuple[int, int, int, int]]:
    """V-Min block (controllable-memory paper, section 4): slots of
    (F, f, B, b) on rank i.

    F is chunk 0's forward, f chunk 1's, B chunk 1's backward, b chunk 0's
    (the letters follow the V: forwards go down F then up f, backwards go
    down B then up b). d = 2 when 3 divides p keeps the residues mod 6 apart.
    """
    p = num_ranks
    d = 2 if p % 3 == 0 else 0
    return [(i, 2 * p - i - 1, 2 * p + d + i, 4 * p + d - i - 1) for i in range(p)]


def v_half_offsets(num_ranks: int) -> list[tuple[int, int, int, int]]:
    """V-Half block (controllable-memory paper, section 4): slots of
    (F, f, B, b) on rank i,
    letters as in `v_min_offsets`; d = 3 when p is even."""
    p = num_ranks
    d = 3 if p % 2 == 0 else 0
    return [
        (2 * i, 3 * p - i - 2, 3 * p + d + 2 * i - 1, 6 * p + d - i - 2) for i in range(p)
    ]


def controllable_memory_block(
    num_ranks: int, fbfb: list[tuple[int, int, int, int]]
) -> BuildingBlock:
    """The building block of per-rank (F, f, B, b) offsets on the V placement,
    with each rank's two W put on its two free residues mod 6 (`place_w`)."""
    p = num_ranks
    offsets = []
    for i, (f0, f1, b1, b0) in enumerate(fbfb):
        s0, s1 = i, 2 * p - 1 - i
        offs = {(s0, Kind.F): f0, (s1, Kind.F): f1, (s1, Kind.B): b1, (s0, Kind.B): b0}
        offs.update(
            place_w({(s1, Kind.B): b1, (s0, Kind.B): b0}, [f0, f1, b1, b0], PERIOD)
        )
        offsets.append(offs)
    return BuildingBlock(v_placement(p), tuple(offsets), PERIOD)


def from_offsets(
    name: str, p: int, m: int, fbfb: list[tuple[int, int, int, int]]
) -> Schedule:
    """The schedule of the block with per-rank (F, f, B, b) slots `fbfb`
    (`controllable_memory_block`), settled (`building_block.settle`)."""
    block = controllable_memory_block(p, fbfb)
    slots = settle(block, m)
    orders = rank_orders(slots, block.stage_to_rank)
    # Chunk activations -> M_B (two chunks per rank).
    peak = max(block_peak(block, r, Kind.B) for r in range(p)) / 2
    peak_w = max(block_peak(block, r, Kind.W) for r in range(p)) / 2
    return Schedule(
        name=name,
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=block.stage_to_rank,
        actions=tuple(tuple(o) for o in orders),
        meta={
            "chunks": 2,
            "placement": "v",
            "period": PERIOD,
            # Per rank: (stage, kind code, slot offset) of one microbatch.
            "block": tuple(
                tuple(sorted(((s, k.value, t) for (s, k), t in offs.items()), key=lambda x: x[2]))
                for offs in block.offsets
            ),
            "steady_peak": peak,
            "steady_peak_until_w": peak_w,
        },
    )


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory",
    NeurIPS 2024, arXiv 2405.15362, section 4): the `v_half_offsets` block
    repeated every 6 slots, squeezed and reordered
    (`stp.schedule.building_block.settle`).

    Peak activation `(p+2)//2 M_B` per rank, about half of 1F1B's `p M_B`
    (a rank's lifespan in the block, summed over its two chunks, is about
    6p slots; over the period 6 that is about p chunk activations of
    M_B / 2 each). Reached from
    m >= (p+2)//2 (fewer microbatches cannot fill it); it holds whether an
    activation is freed at its B or kept until its W (any M_W <= M_B).

    Bubble at T_F = T_B = T_W (unit chunk passes; the longest rank span
    minus its 6m busy slots), the paper's `6p - 1 - 3l` with the block's
    peak `l = 2 ((p+2)//2)` chunk activations: `3p - 7` slots for even p,
    `3p - 4` for odd p >= 3 (1 at p = 2), about half of 1F1B's `6(p-1)`;
    e.g. 5 at p=4 (makespan 53 at m=8), 17 at p=8. It does not grow with m
    (reached from m = 2p at the latest). Accepted for every p >= 1, m >= 1.

    The order is laid out for equal unit passes. Run with other times it
    stays dense in the steady state (the bubble does not grow with m) when
    `T_W + 2T_B >= 2T_F` and `T_W + 2T_F >= 2T_B`, the paper's condition
    for V-Half, with some margin to spare for send latency; otherwise it
    grows with m (simulated at p=4, f=1, b=1.5, w=0.7: about 0.15 per
    microbatch, above 1F1B's from m=33).
    """
    check_sizes("v-half", num_ranks, num_microbatches)
    return from_offsets("v-half", num_ranks, num_microbatches, v_half_offsets(num_ranks))


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory",
    NeurIPS 2024, arXiv 2405.15362, section 4): the `v_min_offsets` block
    repeated every 6 slots, squeezed and reordered
    (`stp.schedule.building_block.settle`).

    Peak activation `(p+4)//3 M_B`, about a third of 1F1B's `p M_B` (a
    rank's lifespan in the block is about 4p slots; over the period 6 that
    is about 2p/3 chunk activations of M_B / 2 each), counted as the paper
    does, an activation alive until its W (M_W = M_B). Freed at its B
    (M_W = 0, our default) the peak is the same except when p % 3 == 2, where
    it is one lower, `(p+1)//3`: the extra activation the paper counts is
    then one whose B has run and whose W has not. Reached from m >= that peak.

    Bubble at T_F = T_B = T_W (as for `v_half`), the paper's `6p - 1 - 3l`
    with `l = 2 ((p+4)//3)`: `4p - 7` slots when 3 divides p, `4p - 5` when
    p % 3 == 1; when p % 3 == 2 it is `4p - 5` too, 4 slots above the count,
    as the block's extra activation there (above) is one the count assumes
    busy (3 at p = 2). About 2/3 of 1F1B's `6(p-1)`: e.g. 11 at p=4, 27 at
    p=8. It does not grow with m (reached from m = 2p at the latest).
    Accepted for every p >= 1 and m >= 1.

    The order is laid out for equal unit passes (the paper's "ideal
    conditions" for V-Min). With unequal times its bubble grows with m:
    simulated at p=4, about 0.2 per microbatch for f=1, b=1.1, w=1 (above
    1F1B's from m=19) and 1.3 for f=1, b=1.5, w=0.7 (above it at m=3).
    """
    check_sizes("v-min", num_ranks, num_microbatches)
    return from_offsets("v-min", num_ranks, num_microbatches, v_min_offsets(num_ranks))
