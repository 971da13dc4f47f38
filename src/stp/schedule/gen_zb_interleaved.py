"""Interleaved Zero Bubble (PyTorch's ScheduleInterleavedZeroBubble, the
"ZB1P" schedule of "Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024,
arXiv 2401.10241, on the looped placement of interleaved 1F1B).

Interleaved 1F1B's issue tables (groups of microbatches through chunk 0,
the same group through chunk 1, ...; backwards by the same table with the
chunks reversed), with three changes that make it zero-bubble:

* split backward: B (input gradient) in the steady phase, W later;
* half the warm-up: rank r runs `min((v-1) g + (p-1-r), m v)` forwards
  before its first B (g = the first group's size), one per hop instead of
  interleaved 1F1B's two, because a B is all that travels back;
* W delayed by r places, as ZB-H1: after each B, the oldest pending W runs
  once more than r are pending; the rest run at the end, oldest first.

PyTorch takes `rounds = max(1, m // p)` groups of `m / rounds` microbatches
and refuses m when `rounds` does not divide it. stp accepts every m >= 1:
it splits m into `rounds` groups whose sizes differ by at most one, larger
first (`gen_classic.interleaved_group_sizes`, as stp's 1f1b-interleaved
does), which are PyTorch's groups whenever PyTorch accepts m, so the order
is PyTorch's action for action there; where PyTorch refuses m it is the
same rule on uneven groups (the warm-up counts the first, larger group),
valid for every p <= 8, m <= 4p, v <= 4 (all checked when written;
tests/schedule/test_gen_torch.py keeps a covering subset).
"""

from __future__ import annotations

from stp.schedule.gen_bfs import check_chunks
from stp.schedule.gen_classic import check_sizes, interleaved_group_sizes, issue_table
from stp.schedule.ir import Kind, Pass, Schedule, looped_schedule

__all__ = ["zb_interleaved", "torch_accepts"]


def torch_accepts(num_ranks: int, num_microbatches: int) -> bool:
    """Whether PyTorch's ScheduleInterleavedZeroBubble takes this m: its
    rounds (`max(1, m // p)`) must divide m."""
    return num_microbatches % max(1, num_microbatches // num_ranks) == 0


def _rank_order(
    r: int, p: int, v: int, table: list[tuple[int, int]], warmup: int
) -> tuple[Pass, ...]:
    """Warm-up forwards; then per B: the next forward (while any), the B,
    and the oldest pending W once more than r are pending; then the rest."""
    forwards = [Pass(c * p + r, Kind.F, mb) for mb, c in table]
    backwards = [Pass((v - 1 - c) * p + r, Kind.B, mb) for mb, c in table]
    order = forwards[:warmup]
    pending: list[Pass] = []
    for k, b in enumerate(backwards):
        if warmup + k < len(forwards):
            order.append(forwards[warmup + k])
        order.append(b)
        pending.append(Pass(b.stage, Kind.W, b.mb))
        if len(pending) > r:
            order.append(pending.pop(0))
    return tuple(order + pending)


def zb_interleaved(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved Zero Bubble with `chunks` (v) stages per rank.

    With T_F = T_B = T_W the steady phase has no bubble; the fill and drain
    cost `(p-1)(T_F+T_B-T_W)/v` in whole-rank times, ZB-H1's bubble over v
    (the simulator measures it; tests/sim/test_new_schedules.py). Peak
    activation on rank r: its warm-up plus the forward of the first steady
    step, `min((v-1) g + p - r, m v) M_B / v`, plus the r delayed W's `M_W`.
    """
    check_sizes("zb-interleaved", num_ranks, num_microbatches)
    check_chunks("zb-interleaved", chunks, 2)
    p, m, v = num_ranks, num_microbatches, chunks
    groups = interleaved_group_sizes(p, m)
    table = issue_table(groups, v)
    warmups = tuple(min((v - 1) * groups[0] + (p - 1 - r), m * v) for r in range(p))
    actions = tuple(_rank_order(r, p, v, table, warmups[r]) for r in range(p))
    note = {} if torch_accepts(p, m) else {"torch_note": (
        f"PyTorch's ScheduleInterleavedZeroBubble refuses m={m} (its {len(groups)} rounds "
        f"do not divide it); this runs groups {'/'.join(map(str, groups))}, larger first")}
    return looped_schedule("zb-interleaved", m, v, actions, groups=groups, warmup=warmups,
                           pending_w=tuple(range(p)), torch_order=torch_accepts(p, m), **note,
                           bubble="(p-1)(T_F+T_B-T_W)/v",
                           peak_activation="min((v-1) g + p - r, m v) M_B / v")
