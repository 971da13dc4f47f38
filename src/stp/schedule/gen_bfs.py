"""Looped breadth-first schedule (LoopedBFS): "Breadth-First Pipeline
Parallelism", Joel Lamy-Poirier, arXiv 2211.05953.

The looped placement of interleaved 1F1B (rank r holds stages r, r+p, ...,
r+(v-1)p), but breadth first: a rank runs every microbatch through a chunk
before the next chunk, all forwards first (as GPipe), then the full
backwards chunk by chunk from the last, each chunk's microbatches in
reverse order (the last forward's activations are the freshest, so its
backward comes first). Per rank:

    F(r, 0..m-1)  F(r+p, 0..m-1) ... F(r+(v-1)p, 0..m-1)
    BW(r+(v-1)p, m-1..0) ... BW(r, m-1..0)

This is PyTorch's ScheduleLoopedBFS order, action for action, for every m
(torch.distributed.pipelining accepts any m >= 1 and any v >= 1).
"""

from __future__ import annotations

from stp.schedule.gen_classic import check_sizes
from stp.schedule.ir import Kind, Pass, Schedule, looped_schedule

__all__ = ["looped_bfs", "check_chunks"]


def check_chunks(name: str, chunks: object, least: int) -> None:
    """Refuse a chunk count that is not an integer >= `least`."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < least:
        raise ValueError(f"{name}: chunks={chunks!r} not accepted; it needs an integer >= {least}")


def looped_bfs(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """LoopedBFS with `chunks` (v) stages per rank on the looped placement.

    Bubble, whole-rank times, full backwards: `(p-1)(T_F+T_B+T_W)/v` for
    m >= p, the depth-first (interleaved 1F1B) bubble, because a chunk's m
    forwards take at least as long as the p hops its first microbatch needs
    to come back to the rank (the paper's argument for m >= p). For m < p
    every loop after the first waits `(p-m)` chunk slots more, forward and
    backward: `(p-1)(T_F+T_B+T_W)/v + (v-1)(p-m)(T_F+T_B+T_W)/v`.
    Peak activation `m M_B` on every rank: all forwards run before any
    backward, as in GPipe (the price of the breadth-first order).
    """
    check_sizes("looped-bfs", num_ranks, num_microbatches)
    check_chunks("looped-bfs", chunks, 1)
    p, m, v = num_ranks, num_microbatches, chunks
    actions = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        order = [Pass(s, Kind.F, i) for s in stages for i in range(m)]
        order += [Pass(s, Kind.BW, i) for s in reversed(stages) for i in reversed(range(m))]
        actions.append(tuple(order))
    return looped_schedule("looped-bfs", m, v, actions,
                           bubble="(p-1)(T_F+T_B+T_W)/v for m >= p",
                           peak_activation="m M_B")
