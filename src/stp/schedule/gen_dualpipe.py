"""DualPipeV: DeepSeek's DualPipe folded into a V ("DeepSeek-V3 Technical
Report", arXiv 2412.19437, section 3.2.1; the deepseek-ai/DualPipe code),
as PyTorch's ScheduleDualPipeV orders it.

V placement (rank r holds stages r and 2p-1-r). Rank r's eight steps, with
chunk 0 = stage r (down the V) and chunk 1 = stage 2p-1-r (up the V):

    1  F0 x 2(p-r-1)                 fill chunk 0
    2  (F0 F1) x (r+1)
    3  (I1 W F1) x (p-r-1)           zero-bubble steps: B of chunk 1, a W
    4  (F0&B1  F1&B0) x (m-2p+r+1)   the main step: overlapped pairs
    5  (B1  F1&B0) x (p-r-1)
    6  (B1 B0) x (r+1)               full backwards; from the middle on, I
    7  (W  B0) x (p-r-1)             (split) so that the W fill the drain
    8  W x (r+1)

`X&Y` is an overlapped pair: a forward of one microbatch and a full
backward of another, on the other chunk. DualPipe overlaps them to hide
expert all-to-all; here a pair is a braided block (`ir.Block`, PyTorch's
`(F;B)OVERLAP_F_B`), so its units interleave and each TP all-reduce runs
under the partner pass's compute, exactly as STP's blocks ("Synergistic
Tensor and Pipeline Parallelism", arXiv 2510.27257). With nothing to hide
(no TP) a braided pair takes what the two passes take in sequence. The
first pair of step 4 on the last rank is not overlapped, as in DualPipe
(it would delay the V tip).

PyTorch refuses m < 2p (fewer microbatches than stages: step 4 would run
a negative number of times). stp accepts them: it builds the 2p schedule
and drops microbatches m..2p-1 (removing every pass of some microbatches
keeps a valid order valid; a pair that loses a pass runs the other alone),
a valid schedule whose warm-up is longer than m needs.
"""

from __future__ import annotations

from stp.schedule.gen_classic import check_sizes
from stp.schedule.ir import Action, Block, Kind, Pass, Schedule, drop_microbatches, v_schedule

__all__ = ["dualpipev"]


class _RankBuilder:
    """One rank's action list with per-stage counters of the next microbatch
    (PyTorch's `counters`) and the queue of pending W."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.w_queue: list[Pass] = []

    def _f(self, stage: int) -> Pass:
        mb = self.next_f.get(stage, 0)
        self.next_f[stage] = mb + 1
        return Pass(stage, Kind.F, mb)

    def _b(self, stage: int, kind: Kind) -> Pass:
        mb = self.next_b.get(stage, 0)
        self.next_b[stage] = mb + 1
        if kind is Kind.B:
            self.w_queue.append(Pass(stage, Kind.W, mb))
        return Pass(stage, kind, mb)

    def forward(self, stage: int) -> None:
        self.actions.append(self._f(stage))

    def backward(self, stage: int, kind: Kind = Kind.BW) -> None:
        self.actions.append(self._b(stage, kind))

    def pair(self, f_stage: int, b_stage: int) -> None:
        self.actions.append(Block((self._f(f_stage), self._b(b_stage, Kind.BW))))

    def weight(self) -> None:
        if self.w_queue:
            self.actions.append(self.w_queue.pop(0))


def _rank_actions(r: int, p: int, m: int) -> list[Action]:
    """The eight steps of the module docstring for rank r (m >= 2p)."""
    s0, s1 = r, 2 * p - 1 - r
    rb = _RankBuilder()
    for _ in range(2 * (p - r - 1)):
        rb.forward(s0)
    for _ in range(r + 1):
        rb.forward(s0)
        rb.forward(s1)
    for _ in range(p - r - 1):
        rb.backward(s1, Kind.B)
        rb.weight()
        rb.forward(s1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            rb.forward(s0)
            rb.backward(s1)
        else:
            rb.pair(s0, s1)
        rb.pair(s1, s0)
    for _ in range(p - r - 1):
        rb.backward(s1)
        rb.pair(s1, s0)
    # Step 6 switches to split backwards half-way; odd ranks one pass
    # earlier, so that the W of both chunks fill the drain (PyTorch's rule).
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        rb.backward(s1, Kind.B if split else Kind.BW)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        rb.backward(s0, Kind.B if split else Kind.BW)
    for _ in range(p - r - 1):
        rb.weight()
        rb.backward(s0, Kind.B if split else Kind.BW)
    for _ in range(r + 1):
        rb.weight()
    return rb.actions


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on p ranks (2p stages in a V), m microbatches.

    The DualPipe README gives its bubble as `(PP/2-1)(F&B + B - 3W)` in chunk
    times (PP = 2p stages, B a chunk's full backward, F&B an overlapped
    pair) and its activation as `PP+1` chunks. Simulated with nothing to
    hide, this order's critical rank 0 waits `(p-1)(3T_F/2 + T_B - T_W)`
    (T_B the input-gradient part) when T_W <= T_B <= T_F < T_B + T_W, less
    than the README's by `(p-1)(T_B - T_F/2)`; the peak is the README's,
    `2p+1` chunk activations (`(p+1/2) M_B`) on every rank, for m >= 2p
    (tests/sim/test_new_schedules.py).
    """
    check_sizes("dualpipev", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    full = max(m, 2 * p)
    actions = [drop_microbatches(_rank_actions(r, p, full), m) for r in range(p)]
    note = {} if m >= 2 * p else {"torch_note": (
        f"PyTorch's ScheduleDualPipeV refuses m={m} < 2p={2 * p}; this is its "
        f"m={2 * p} order with microbatches {m}..{2 * p - 1} dropped")}
    return v_schedule("dualpipev", m, actions, torch_order=m >= 2 * p, **note,
                      bubble="(p-1)(F&B+B-3W)", peak_activation="(2p+1) M_B / 2")
