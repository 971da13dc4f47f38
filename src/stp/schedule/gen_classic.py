"""Classic schedules with full backwards: GPipe, 1F1B, interleaved 1F1B.

Each generator is a pure function `(num_ranks, num_microbatches, ...) ->
Schedule`: the schedule is data, never control flow. Orders are per rank; the
validator decides whether they deadlock, the simulator times them.

Notation: p ranks, m microbatches, v chunks per rank, T_F / T_B / T_W the
forward, input-gradient and weight-gradient times of one microbatch through
one rank's whole share, M_B one microbatch's activations on one rank.
"""

from __future__ import annotations

from stp.schedule.ir import Kind, Pass, Schedule, looped_schedule

__all__ = [
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "interleaved_group_sizes",
    "issue_table",
    "check_sizes",
]


def check_sizes(name: str, num_ranks: object, num_microbatches: object) -> None:
    """Refuse a pipeline size or microbatch count that is not a positive int."""
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"{name}: pipeline size {num_ranks!r} not accepted; it needs pp >= 1")
    if (
        not isinstance(num_microbatches, int)
        or isinstance(num_microbatches, bool)
        or num_microbatches < 1
    ):
        raise ValueError(
            f"{name}: {num_microbatches!r} microbatches not accepted; it needs at least 1"
        )


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019, arXiv 1811.06965): every rank runs all m forwards, then all m
    full backwards in microbatch order.

    Bubble `(p-1)(T_F+T_B+T_W)`: the p-1 forward slots of the fill and the
    p-1 backward slots of the drain; every rank holds all `m M_B` at its peak.
    """
    check_sizes("gpipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    actions = tuple(
        tuple(Pass(r, Kind.F, i) for i in range(m)) + tuple(Pass(r, Kind.BW, i) for i in range(m))
        for r in range(p)
    )
    return Schedule(
        name="gpipe",
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=tuple(range(p)),
        actions=actions,
        meta={
            "chunks": 1,
            "bubble": "(p-1)(T_F+T_B+T_W)",
            "peak_activation": "m M_B",
        },
    )


def _one_f_one_b_order(
    forwards: list[Pass], backwards: list[Pass], warmup: int
) -> tuple[Pass, ...]:
    """`warmup` forwards, then (F, BW) pairs while forwards remain, then the
    remaining backwards. Shared by 1F1B and interleaved 1F1B (Megatron-LM's
    warm-up / steady / cool-down loop)."""
    assert len(forwards) == len(backwards) and 0 <= warmup <= len(forwards)
    order = list(forwards[:warmup])
    steady = len(forwards) - warmup
    for k in range(steady):
        order += [forwards[warmup + k], backwards[k]]
    order += backwards[steady:]
    return tuple(order)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream, arXiv 1806.03377; PipeDream-Flush, Narayanan et al.
    2021; Megatron-LM's default, arXiv 2104.04473).

    Rank s runs `min(p-s-1, m)` warm-up forwards, then alternates one
    forward and one full backward, then drains the remaining backwards.

    Bubble `(p-1)(T_F+T_B+T_W)`, as GPipe, but rank s holds at most
    `min(p-s, m) M_B`: `min(p, m) M_B` on rank 0, its p-1 warm-up
    forwards plus the one of the first steady pair.
    """
    check_sizes("1f1b", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    actions = []
    warmups = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        warmups.append(warmup)
        forwards = [Pass(r, Kind.F, i) for i in range(m)]
        backwards = [Pass(r, Kind.BW, i) for i in range(m)]
        actions.append(_one_f_one_b_order(forwards, backwards, warmup))
    return Schedule(
        name="1f1b",
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=tuple(range(p)),
        actions=tuple(actions),
        meta={
            "chunks": 1,
            "warmup": tuple(warmups),
            "bubble": "(p-1)(T_F+T_B+T_W)",
            "peak_activation": "min(p, m) M_B",
        },
    )


def interleaved_group_sizes(num_ranks: int, num_microbatches: int) -> tuple[int, ...]:
    """Microbatch groups of interleaved 1F1B, in issue order.

    Megatron-LM issues microbatches in groups of p per chunk and accepts only
    m a multiple of p (with its default group size). PyTorch's
    ScheduleInterleaved1F1B uses `rounds = max(1, m // p)` groups of
    `m / rounds` and accepts m when `rounds` divides it. We take the same
    `rounds` and split m into groups whose sizes differ by at most one,
    larger first: the groups are exactly Megatron's when p divides m and
    exactly PyTorch's whenever PyTorch accepts m. Every group has at least
    p microbatches when m >= p and none is larger than the first, whose size
    sets the warm-up. Both matter: a trailing group smaller than p (what
    Megatron's check refuses) stalls the next chunk and can deadlock, and a
    group larger than the first can put a backward before its own forward
    (both seen when validating every p <= 8, m <= 5p + 2, v <= 4).
    """
    rounds = max(1, num_microbatches // num_ranks)
    q, rem = divmod(num_microbatches, rounds)
    return (q + 1,) * rem + (q,) * (rounds - rem)


def issue_table(groups: tuple[int, ...], chunks: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in forward issue order: per group, chunk by chunk,
    the group's microbatches in order (Megatron-LM's schedule table)."""
    table = []
    start = 0
    for g in groups:
        table += [(mb, c) for c in range(chunks) for mb in range(start, start + g)]
        start += g
    return table


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21, "Efficient Large-Scale
    Language Model Training on GPU Clusters using Megatron-LM", section 2.2).

    Looped placement: rank r holds stages r, r+p, ..., r+(v-1)p (v = chunks).
    Each rank issues forwards by the schedule table (a group of microbatches
    through chunk 0, the same group through chunk 1, ..., then the next
    group) and full backwards by the same table with chunks reversed. Rank r
    runs `min(2(p-r-1) + (v-1)g, m v)` warm-up forwards (g = the first
    group's size, p when p divides m), then alternates one forward and one
    backward, then drains the remaining backwards (Megatron-LM's
    forward_backward_pipelining_with_interleaving).

    Any m >= 1 is accepted; groups as `interleaved_group_sizes`. The order is
    Megatron-LM's when p divides m and PyTorch's ScheduleInterleaved1F1B's
    whenever PyTorch accepts m.

    Bubble `(p-1)(T_F+T_B+T_W)/v` in whole-rank times (Megatron paper,
    section 2.2.2, m a multiple of p; with these groups it stays exact for
    every m >= p, see the tests). Peak activation on rank r is
    `min(w_r + 1, m v) M_B / v` with w_r the warm-up count above, so
    `min((v+1)p - 1, m v) M_B / v` on rank 0 when p divides m: one more
    chunk than the warm-up because the steady state's forward starts before
    its paired backward frees memory. (The STP table's `3p-2` chunk
    activations for v=2 equals the warm-up count alone.) Larger groups (m not a
    multiple of p) raise the warm-up, and with it the peak, by (v-1) chunks
    per extra microbatch in the first group.
    """
    check_sizes("1f1b-interleaved", num_ranks, num_microbatches)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 2:
        raise ValueError(
            f"1f1b-interleaved: chunks={chunks!r} not accepted; it needs an integer >= 2 "
            "(use 1f1b for one chunk per rank)"
        )
    p, m, v = num_ranks, num_microbatches, chunks
    groups = interleaved_group_sizes(p, m)
    table = issue_table(groups, v)
    total = m * v
    actions = []
    warmups = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * groups[0], total)
        warmups.append(warmup)
        forwards = [Pass(c * p + r, Kind.F, mb) for mb, c in table]
        backwards = [Pass((v - 1 - c) * p + r, Kind.BW, mb) for mb, c in table]
        actions.append(_one_f_one_b_order(forwards, backwards, warmup))
    return looped_schedule("1f1b-interleaved", m, v, actions, groups=groups,
                           warmup=tuple(warmups), bubble="(p-1)(T_F+T_B+T_W)/v",
                           peak_activation="min(w_r + 1, m v) M_B / v")
