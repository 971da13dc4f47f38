"""The STP schedule: V placement with braided blocks.

STP (Qi, Peng et al., NeurIPS 2025, "Synergistic Tensor and Pipeline
Parallelism", arXiv 2510.27257, Fig. 5) runs two chunks per rank on the V
placement (rank r holds stage r = chunk 0 and stage 2p-1-r = chunk 1,
`v_placement`) and pairs passes of different microbatches into braided
blocks, so one pass computes while the other's TP all-reduce is in flight:

    alone:    [Attn F]..AR..[MLP F]..AR..            AR exposed
    braided:  [Attn F][MLP dB][MLP dW][MLP F][Attn dB][Attn dW]
                      \\_AR(Attn F) hidden under MLP dB, and so on

Per-rank order (as the authors' published code emits it; for p=4, m=12 it
matches the paper's Fig. 5 cell for cell; rank r, p ranks, m microbatches;
F0/F1 forward of chunk 0/1, B1/B0 backward of chunk 1/0):

    1. 2(p-r-1) x F0
    2. r+1 x (F0, F1)
    3. r+1 x F0: a lone F0 first if r+1 is odd, then pairs braided as FF0
    4. p-r-1 x [FB1 with W deferred, FW0]
    5. 2(m-3p+1)+1+2r blocks FB1, FB0, FB1, ...; only the last r defer W
    6. 2p-r-2 x [B0 with its W, FB1 with W deferred]
    7. r+1 x [B0, B1]
    8. 1+2(p-r-1) steps B0, (W, W), B0, ..., B0
    9. 2r x W

Blocks in the IR (`Block`, forward first):
    FB with W deferred  (F, B)   B is Kind.B; its W joins a FIFO of deferred W
    FB otherwise        (F, BW)  the full backward runs its W right after B
    FW0                 (F0, W)  the oldest deferred W
    FF0                 (F0, F0) two consecutive chunk-0 microbatches
Each of F0, F1, B1, B0 takes the next microbatch of its own counter.

Interpretations (each forced by validity, by the counts m F / m B / m W per
chunk, and by the paper's TP-bubble count, which holds only if nothing but
warm-up forwards runs alone with an exposed all-reduce):

  a. Phases 7-8's B0 and B1 are full backwards (Kind.BW), like phase 6's
     "B0 with its W". Counting the FIFO: phases 4-6 defer (p-r-1) + r +
     (2p-r-2) W and phase 4's FW0 take p-r-1, leaving 2p-2; phases 8 and 9
     take 2(p-r-1) + 2r = 2p-2. Deferring the W of phases 7-8 as well would
     leave W that no phase runs.
  b. Phase 8's "(W, W)" is two plain W passes, oldest first. A W has no TP
     all-reduce, so it needs no partner (and a Block must start with an F).
     By (a) the FIFO holds 2p-2 >= 2(p-r-1) W there, so two are always there.
  c. Each FW0 takes exactly one W, the oldest; in phase 4 that is the W of
     the FB1 just before it, so the FIFO is empty after every pair.
  d. "Only the last r defer W" counts all phase-5 blocks, FB0 included: on
     rank r >= 2 a chunk-0 W is deferred too (p=4, rank 2 defers 2W2).
  e. Every FB block pairs the next F of its chunk with the oldest backward
     of the same chunk not yet run (the counters). Nothing but forwards runs
     alone with an exposed all-reduce: the lone passes are the warm-up
     forwards (2(p-r-1) + 2(r+1), plus one F0 when r+1 is odd), full
     backwards (B's all-reduce hides under its own W) and W (no all-reduce).
  f. p = 1 needs no special case: rank 0 holds stages 0 and 1, the V tip is
     local, and the phases above give F0 F1 F0 (FB1 FB0)... B0 B1 B0.

Small m. The phase counts are non-negative and add up exactly when
m >= 3p-1 (phase 5 has 2(m-3p+1)+1 >= 1 blocks on rank 0). The published code
accepts m >= 2p and then runs the wrong number of passes. For 1 <= m < 3p-1
this generator builds the schedule for m0 = 3p-1 and deletes every pass of the
microbatches m..m0-1; a block left with one pass becomes that plain pass.
Since each counter hands out microbatches in order, the deleted passes are
the tail of each kind, and the result stays complete and deadlock-free: any
cycle among the kept actions (program order plus data dependencies) would be
a cycle through the same passes in the m0 schedule, which validates.
Braiding then thins out (fewer partners exist), as it must with so few
microbatches; the phase counts above hold only from m = 3p-1.

Peak activation (the paper's comparison table: 3p M_a on rank 0, M_a = one
microbatch in one chunk = 1/2 of our M_B unit). Rank r holds 2p chunk-0 and r+1 chunk-1
activations after phases 1-3; each of the p-r-1 phase-4 pairs adds one net
(FB1 allocates one and frees one, FW0 allocates one), so every rank holds
2p + (r+1) + (p-r-1) = 3p M_a between blocks: the paper's figure, balanced
by the V placement. `peak_by_order` counts a braided F+B block with its
forward allocated at the start and its backward freed at the end
(memory.action_memory), so each FB block of phase 5 shows 3p+1 M_a =
(3p+1)/2 M_B. That extra M_a is an upper bound of a real transient: inside
the block the forward's units store activations while the backward's units
have not yet released all of theirs.
"""

from __future__ import annotations

from collections import deque

from stp.schedule.ir import Action, Block, Kind, Pass, Schedule, drop_microbatches, v_schedule

__all__ = ["stp", "full_phase_min_microbatches"]


def full_phase_min_microbatches(num_ranks: int) -> int:
    """Smallest m for which the nine phases run exactly as the paper writes
    them (3p-1); below it the schedule is the m=3p-1 one with microbatches
    m..3p-2 removed (see the module docstring)."""
    return 3 * num_ranks - 1


class _RankOrder:
    """One rank's action list under construction: a microbatch counter for
    each of F0, F1, B0, B1 and the FIFO of deferred W."""

    def __init__(self, num_ranks: int, rank: int) -> None:
        self.stage = (rank, 2 * num_ranks - 1 - rank)  # chunk 0, chunk 1
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.deferred: deque[Pass] = deque()
        self.actions: list[Action] = []

    def f(self, chunk: int) -> Pass:
        mb = self.next_f[chunk]
        self.next_f[chunk] += 1
        return Pass(self.stage[chunk], Kind.F, mb)

    def b(self, chunk: int, *, defer: bool) -> Pass:
        """The next backward of `chunk`: Kind.B with its W queued, or Kind.BW."""
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        if not defer:
            return Pass(self.stage[chunk], Kind.BW, mb)
        self.deferred.append(Pass(self.stage[chunk], Kind.W, mb))
        return Pass(self.stage[chunk], Kind.B, mb)

    def w(self) -> Pass:
        """The oldest deferred W."""
        assert self.deferred, "W requested with no deferred W queued"
        return self.deferred.popleft()

    def emit(self, *passes: Pass) -> None:
        self.actions.append(passes[0] if len(passes) == 1 else Block(passes))

    def fb(self, chunk: int, *, defer: bool) -> None:
        """F of `chunk` braided with the next backward of the same chunk."""
        self.emit(self.f(chunk), self.b(chunk, defer=defer))


def _rank_order(p: int, m: int, r: int) -> list[Action]:
    """Rank r's actions for m >= 3p-1, phase by phase (module docstring)."""
    o = _RankOrder(p, r)
    for _ in range(2 * (p - r - 1)):  # 1. warm-up, chunk 0 only
        o.emit(o.f(0))
    for _ in range(r + 1):  # 2. reach the V tip and start chunk 1
        o.emit(o.f(0))
        o.emit(o.f(1))
    if (r + 1) % 2:  # 3. lone F0, then F0 pairs braided with each other
        o.emit(o.f(0))
    for _ in range((r + 1) // 2):
        o.emit(o.f(0), o.f(0))  # arguments evaluate left to right: mb a, a+1
    for _ in range(p - r - 1):  # 4. FB1 defers its W, FW0 runs it
        o.fb(1, defer=True)
        o.emit(o.f(0), o.w())
    steady = 2 * (m - 3 * p + 1) + 1 + 2 * r  # 5. FB1, FB0, FB1, ...
    for i in range(steady):
        o.fb(1 if i % 2 == 0 else 0, defer=i >= steady - r)
    for _ in range(2 * p - r - 2):  # 6. drain chunk 0 with full backwards
        o.emit(o.b(0, defer=False))
        o.fb(1, defer=True)
    for _ in range(r + 1):  # 7. last chunk-1 backwards, all full
        o.emit(o.b(0, defer=False))
        o.emit(o.b(1, defer=False))
    for i in range(1 + 2 * (p - r - 1)):  # 8. B0, (W, W), B0, ...
        if i % 2 == 0:
            o.emit(o.b(0, defer=False))
        else:
            o.emit(o.w())
            o.emit(o.w())
    for _ in range(2 * r):  # 9. the remaining deferred W
        o.emit(o.w())
    # The counts of interpretation (a): every counter ends at m, FIFO empty.
    assert o.next_f == [m, m] and o.next_b == [m, m], (r, o.next_f, o.next_b)
    assert not o.deferred, (r, list(o.deferred))
    return o.actions


def stp(num_ranks: int, num_microbatches: int) -> Schedule:
    """The STP schedule (arXiv 2510.27257, Fig. 5) for `num_ranks` ranks on the V
    placement and `num_microbatches` microbatches (any m >= 1; the paper's
    nine phases hold exactly from m = 3p-1, see the module docstring).

    Raises ValueError for num_ranks < 1 or num_microbatches < 1.
    """
    p, m = num_ranks, num_microbatches
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"stp: pipeline size {p!r} not accepted; it needs pp >= 1")
    if not isinstance(m, int) or m < 1:
        raise ValueError(
            f"stp: {m!r} microbatches not accepted at pp={p}; it needs at least 1"
        )
    m0 = max(m, full_phase_min_microbatches(p))
    rows = [drop_microbatches(_rank_order(p, m0, r), m) for r in range(p)]
    return v_schedule("stp", m, rows, placement="v", braided=True,
                      full_phase_min_microbatches=full_phase_min_microbatches(p),
                      truncated_from=m0 if m0 > m else None)
