"""Zero Bubble handcrafted schedules ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024, arXiv 2401.10241, section 2).

Both split the full backward into B (input gradient, on the critical path
between ranks) and W (weight gradient, needed by no other rank), so a rank
can put W wherever it fills a gap. One stage per rank (identity placement).

Rank s's order is one loop with two knobs, the warm-up count and how many
W it keeps pending:

    F x warmup
    repeat for every microbatch:  B;  W (oldest) if pending W > keep;  F (next) if any
    the leftover W, oldest first

    ZB-H1: warmup = min(p-s, m),     keep = s     (memory as 1F1B)
    ZB-H2: warmup = min(2(p-s)-1, m), keep = 2s   (zero bubble at 2p-1 M_B)

With unit passes, p=3, m=6, ZB-H2 reads (each rank's span is 3m = 18):

    rank 0  F0 F1 F2 F3 F4 B0 W0 F5 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5
    rank 1     F0 F1 F2 B0 F3 B1 F4 B2 W0 F5 B3 W1 B4 W2 B5 W3 W4 W5
    rank 2        F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 W0 F5 B5 W1 W2 W3 W4 W5
"""

from __future__ import annotations

from stp.schedule.gen_classic import check_sizes
from stp.schedule.ir import Kind, Pass, Schedule

__all__ = ["zb_h1", "zb_h2"]


def _split_backward_order(stage: int, m: int, warmup: int, keep: int) -> tuple[Pass, ...]:
    """The loop of the module docstring for one rank."""
    assert 0 <= warmup <= m and keep >= 0
    order = [Pass(stage, Kind.F, i) for i in range(warmup)]
    next_f = warmup
    pending: list[int] = []  # microbatches whose B ran and W did not, oldest first
    for i in range(m):
        order.append(Pass(stage, Kind.B, i))
        pending.append(i)
        if len(pending) > keep:
            order.append(Pass(stage, Kind.W, pending.pop(0)))
        if next_f < m:
            order.append(Pass(stage, Kind.F, next_f))
            next_f += 1
    order += [Pass(stage, Kind.W, i) for i in pending]
    return tuple(order)


def _build(
    name: str, p: int, m: int, warmups: list[int], keeps: list[int], meta: dict[str, object]
) -> Schedule:
    actions = tuple(_split_backward_order(s, m, warmups[s], keeps[s]) for s in range(p))
    return Schedule(
        name=name,
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=tuple(range(p)),
        actions=actions,
        meta={"chunks": 1, "warmup": tuple(warmups), "pending_w": tuple(keeps), **meta},
    )


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1, the memory-efficient handcrafted schedule (Zero Bubble,
    arXiv 2401.10241, section 2.1, Fig. 3 top).

    Rank s runs `min(p-s, m)` forwards before its first B, as many as 1F1B
    has in flight, and delays its W by s places: the W then fill the tail
    bubble of 1F1B, so the B chain runs earlier.

    Bubble `(p-1)(T_F+T_B-T_W)` for m >= p, one third of 1F1B's when
    T_F = T_B = T_W, the paper's assumption (it also holds exactly whenever
    T_W <= T_F). Peak activation `min(p-s, m) M_B` on rank s, so
    `min(p, m) M_B` on rank 0 as 1F1B; the s delayed W keep `s M_W` more
    on rank s (M_W < M_B, so rank 0 stays the peak in the paper's units).
    """
    check_sizes("zb-h1", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    return _build(
        "zb-h1",
        p,
        m,
        warmups=[min(p - s, m) for s in range(p)],
        keeps=list(range(p)),
        meta={"bubble": "(p-1)(T_F+T_B-T_W)", "peak_activation": "min(p, m) M_B"},
    )


def zb_h2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2, the zero-bubble handcrafted schedule (Zero Bubble,
    arXiv 2401.10241, section 2.2, Fig. 3 bottom).

    Rank s runs `min(2(p-s)-1, m)` warm-up forwards, filling the whole gap
    before its first B arrives, and delays its W by 2s places, which turns
    the tail from a trapezoid into a parallelogram.

    Bubble `(p-1)(T_F+T_B-2T_W)` for m >= 2p-1: zero when T_F = T_B = T_W,
    the paper's assumption (exact whenever T_W <= min(T_F, T_B)). Peak
    activation `min(2(p-s)-1, m) M_B` on rank s, so `min(2p-1, m) M_B` on
    rank 0.

    Small m: the published rule needs no change. Capping the warm-up at m
    keeps every rank's warm-up at least one larger than its successor's, or
    at m (all forwards first), so each forward a rank needs is produced
    before its predecessor blocks on a backward: the order is valid and
    deadlock-free for every m >= 1. A delay of 2s larger than m just moves
    all W to the end. For m < 2p-1 the bubble lies between the formula and
    ZB-H1's; it equals ZB-H1's for m <= p.
    """
    check_sizes("zb-h2", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    return _build(
        "zb-h2",
        p,
        m,
        warmups=[min(2 * (p - s) - 1, m) for s in range(p)],
        keeps=[2 * s for s in range(p)],
        meta={"bubble": "(p-1)(T_F+T_B-2T_W)", "peak_activation": "min(2p-1, m) M_B"},
    )
