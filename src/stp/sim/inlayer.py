"""In-layer TP overlap: a unit's collectives cut into K chunks along the sequence.

Megatron-LM's `--tp-comm-overlap`, torchtitan's async TP and FLUX cut a
tensor-parallel unit's rows into K chunks so that one chunk's all-gather or
reduce-scatter runs while another chunk's matmuls compute. This module times
one unit so cut; `stp.sim.engine` uses it for every pass that runs it
(`stp simulate --tp-overlap`).

One unit (an F or B unit of `stp.sim.units`: attention or MLP of one layer)
with its all-gather `a` before it, its compute `g`, its reduce-scatter `r`
after it (sequence parallelism; without it `a` = 0 and `r` is the unit's
all-reduce, each chunk's reduced after the chunk's matmuls), cut into K chunks:

    AG_k   a/K + L (K-1)/K   on the TP lane (chunk k's rows gathered)
    G_k    g / (K e)         on the compute lane (chunk k's matmuls)
    RS_k   r/K + L (K-1)/K   on the TP lane (chunk k's partial output scattered)

`L` is what one more collective call costs (its launch and the ring's
latency steps, `stp.costmodel.inlayer`), so the K pieces cost `(K-1) L` more
than the whole collective; `e` <= 1 is the matmuls' efficiency at s/K rows
relative to s rows (smaller GEMMs run below peak). G_k waits for AG_k; the
TP lane runs pieces one at a time in the order they are issued: AG_{k+1} when
G_k starts (one chunk of prefetch, as the runtime does), RS_k when G_k ends.
So the lane runs AG_1, AG_2, RS_1, AG_3, RS_2, ..., AG_K, RS_{K-1}, RS_K.

With equal pieces a' = a/K + L(K-1)/K, r' likewise, g' = g/(K e), the unit
takes (from AG_1's start)

    T = a' + K g' + r'                          when g' >= a' + r' (compute bound:
                                                 only the first gather and the last
                                                 scatter are exposed)
    T = K (a' + r') + max(0, g' - r')           when g' <= a' (collective bound:
                                                 the TP lane never rests)

and in between whatever the event rule above gives (`chunk_timeline`). Its
exposed TP time is T - K g'; the efficiency lost, `g (1/e - 1)`, is compute.
Without chunking (K = 1, or nothing to overlap) T = a + g + r, as a pass on
its own runs.

A deferred weight-gradient unit W needs its column-parallel linears' input,
which sequence parallelism keeps only as the s/t shard: the runtime gathers
it again in W, in K chunks under the chunks of the dW matmul (dW = sum_k
dy_k^T x_k). It is priced the same way with `r` = 0:
`T = max(a' + K g', K a' + g')`. Without chunking, and in a braided
block, this gather is not charged (`stp.sim.engine`); `--tp-overlap-chunks 1`
charges it whole on the passes that run alone.

The hybrid (`braid=True` with in-layer overlap, mode "both"): a braided block
keeps the braid rule (its passes hide each other's collectives, whole); a
pass that runs alone (a V's warm-up and cool-down, every action of an
unbraided schedule) is chunked. Mode "in-layer" runs every block pass by
pass, each chunked; "none" runs them pass by pass unchunked.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InLayer", "ChunkTimeline", "chunk_timeline", "MODES", "mode_name", "MAX_CHUNKS"]

MAX_CHUNKS = 64
"""Most chunks a unit is cut into (past a few, launch costs dominate)."""

MODES = ("none", "braided", "in-layer", "both")
"""How TP collectives are overlapped: not at all (blocks run pass by pass),
by braiding, by chunking every pass (blocks pass by pass), or the hybrid."""


@dataclass(frozen=True)
class InLayer:
    """How a chunked unit is timed (module doc). Times in the `Costs` unit."""

    chunks: int = 4
    """K: pieces each collective and each unit's matmuls are cut into."""
    launch: float = 0.0
    """L: what one more collective call costs (launch plus the ring's latency steps)."""
    efficiency: float = 1.0
    """e: matmul efficiency at s/K rows relative to s rows, in (0, 1]."""

    def __post_init__(self) -> None:
        k = self.chunks
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CHUNKS:
            raise ValueError(f"--tp-overlap-chunks {k!r}: an integer from 1 to {MAX_CHUNKS}")
        launch = self.launch
        if isinstance(launch, bool) or not isinstance(launch, int | float) or not (
                0 <= launch < float("inf")):
            raise ValueError(f"chunk launch cost {launch!r}: a finite number >= 0")
        eff = self.efficiency
        if isinstance(eff, bool) or not isinstance(eff, int | float) or not 0 < eff <= 1:
            raise ValueError(f"chunk GEMM efficiency {eff!r}: a number in (0, 1]")


def mode_name(braid: bool, in_layer: InLayer | None) -> str:
    """One of MODES, for tables and labels ("both" for the hybrid)."""
    if in_layer is None:
        return "braided" if braid else "none"
    return "both" if braid else "in-layer"


@dataclass(frozen=True)
class ChunkTimeline:
    """One chunked unit, timed."""

    end: float
    """When its last piece ends (its output is final)."""
    compute_end: float
    """When its last matmul chunk ends (the compute lane is free)."""
    comm_end: float
    """When its last collective piece ends (the TP lane is free)."""
    busy: float
    """Compute-lane time of its matmul chunks, K g'."""
    comm: float
    """TP-lane time of its pieces, K (a' + r')."""
    pieces: tuple[tuple[str, float, float], ...] = ()
    """(kind, start, end) of every piece when asked for: G (compute), AG, RS."""


def chunk_timeline(start: float, comm_start: float, g: float, a: float, r: float,
                   plan: InLayer, record: bool = False) -> ChunkTimeline:
    """Time a unit of compute `g` between an all-gather `a` and a reduce-scatter
    `r`, cut into `plan.chunks` (module doc). The compute lane is free from
    `start`, the TP lane from `comm_start`."""
    k = plan.chunks
    if k == 1 or (a <= 0 and r <= 0):
        t0 = max(start, comm_start + a) if a > 0 else start
        end = t0 + g + r
        pieces = ((("AG", comm_start, comm_start + a),) if a > 0 else ()) + (
            ("G", t0, t0 + g),) + ((("RS", t0 + g, end),) if r > 0 else ())
        comm_end = end if r > 0 else comm_start + a if a > 0 else comm_start
        return ChunkTimeline(end, t0 + g, comm_end, g, a + r, pieces if record else ())
    extra = plan.launch * (k - 1) / k
    ap = a / k + extra if a > 0 else 0.0
    rp = r / k + extra if r > 0 else 0.0
    gp = g / k / plan.efficiency
    out: list[tuple[str, float, float]] = []
    comm = comm_start
    gathered = float("-inf")  # no gather: a chunk waits for nothing
    if ap:
        gathered = comm = comm + ap
        out.append(("AG", comm - ap, comm))
    prev = start
    for i in range(k):
        gs = max(prev, gathered)
        if ap and i + 1 < k:  # the next chunk's gather, issued as this one computes
            s = max(comm, gs)
            gathered = comm = s + ap
            out.append(("AG", s, comm))
        ge = gs + gp
        out.append(("G", gs, ge))
        if rp:  # this chunk's scatter, issued as its matmuls end
            s = max(comm, ge)
            comm = s + rp
            out.append(("RS", s, comm))
        prev = ge
    return ChunkTimeline(max(prev, comm), prev, comm, k * gp, k * (ap + rp),
                         tuple(out) if record else ())
