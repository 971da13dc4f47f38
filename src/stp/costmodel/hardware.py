"""A GPU and its links, and the alpha-beta times of the transfers a step makes.

Times follow the usual latency-bandwidth (alpha-beta) model (Hockney 1994;
Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005):

    point-to-point   T = alpha + n / beta
    ring all-reduce  T = 2 (t-1) alpha + 2 (t-1)/t * n / beta
    ring all-gather  T = (t-1) alpha + (t-1)/t * n / beta     (n: the gathered bytes)
    ring reduce-scatter, the same                              (n: the bytes reduced)

Each rank of a ring moves (t-1)/t of the bytes once in an all-gather or a
reduce-scatter, and twice in an all-reduce, which is exactly a
reduce-scatter followed by an all-gather (Thakur et al., section 4.4):
sequence parallelism's two collectives cost what the all-reduce they
replace cost.

with `n` bytes, `t` ranks, `beta` the bandwidth of one direction of one link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["HardwareSpec", "allgather_time", "allreduce_time", "p2p_time",
           "reduce_scatter_time", "GEMM_ROWS_ASSUMED", "parse_gemm_rows"]

GEMM_ROWS_ASSUMED: tuple[tuple[float, float], ...] = (
    (128.0, 0.6), (256.0, 0.75), (512.0, 0.86), (1024.0, 0.93), (2048.0, 0.97), (4096.0, 1.0))
"""Matmul efficiency against rows (tokens) relative to a large matmul: ASSUMED, not
measured, for a 16-bit GEMM of a TP shard's width (a few thousand) on an A100 / H100:
the tensor cores' tiles (128 x 128 or 256 x 128 output tiles) fill the SMs less
well and the weight is read once per fewer rows as rows shrink; above ~4k rows
the GEMM runs at its large-matrix rate. `stp plan --hardware local` measures this
machine's curve instead (`stp.plan.calibrate.gemm_rows_fit`)."""


def parse_gemm_rows(text: str) -> tuple[tuple[float, float], ...]:
    """`512:0.86/1024:0.93/4096:1` -> ((rows, relative efficiency), ...),
    rows increasing, each efficiency in (0, 1]."""
    points = []
    for item in str(text).split("/"):
        rows, sep, eff = item.partition(":")
        try:
            point = (float(rows), float(eff)) if sep else None
        except ValueError:
            point = None
        if point is None or not (math.isfinite(point[0]) and point[0] >= 1
                                 and 0 < point[1] <= 1):
            raise ValueError(f"hardware gemm_rows item {item.strip()[:40]!r}: ROWS:EFFICIENCY "
                             "expected (rows >= 1, efficiency in (0, 1]), items joined by /")
        points.append(point)
    return _checked_rows(tuple(points))


def _checked_rows(points: tuple) -> tuple[tuple[float, float], ...]:
    try:
        out = tuple((float(r), float(e)) for r, e in points)
    except (TypeError, ValueError):
        raise ValueError(f"hardware gemm_rows={points!r}: (rows, efficiency) pairs "
                         "expected") from None
    if not out or any(not (math.isfinite(r) and r >= 1 and 0 < e <= 1) for r, e in out):
        raise ValueError(f"hardware gemm_rows={points!r}: rows >= 1 with efficiencies in "
                         "(0, 1] expected")
    if any(b[0] <= a[0] for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"hardware gemm_rows={points!r}: rows must increase")
    return out


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and the links a TP x PP step uses. Units: FLOP/s, bytes/s, s."""

    peak_flops: float
    """Dense 16-bit matmul peak of one GPU (FLOP/s)."""
    efficiency: float = 0.5
    """Fraction of the peak a transformer layer's matmuls achieve (MFU of one pass)."""
    tp_bandwidth: float = 150e9
    """Bytes/s one direction between GPUs of a TP group (usually NVLink)."""
    tp_latency: float = 5e-6
    """Seconds per step of the TP ring."""
    pp_bandwidth: float = 25e9
    """Bytes/s one direction between neighbouring pipeline stages."""
    pp_latency: float = 10e-6
    """Seconds of one pipeline send."""
    host_bandwidth: float = 25e9
    """Bytes/s between GPU and host memory (PCIe), for activation offload."""
    name: str = "custom"
    memory: float = 0.0
    """Bytes of device memory one GPU offers (what nvidia-smi reports as total);
    0: not known (a custom spec that does not say)."""
    node_gpus: int = 8
    """GPUs of one node, linked at `tp_bandwidth` (NVLink); a collective whose group
    spans more runs its inter-node share at `pp_bandwidth` (expert parallelism's
    all-to-all, `stp.costmodel.moe`)."""
    tp_chunk_launch: float = 10e-6
    """Seconds one more collective call costs beyond its ring steps (`tp_latency`
    each): the kernel launch and the library's per-call set-up that in-layer TP
    overlap pays once per chunk (`stp.costmodel.inlayer`). ASSUMED: NCCL's
    small-message collectives take about 10-20 us end to end on NVLink."""
    gemm_rows: tuple[tuple[float, float], ...] = GEMM_ROWS_ASSUMED
    """(rows, matmul efficiency relative to the largest rows) points, rows
    increasing; between points the efficiency is interpolated in log2(rows), outside
    them held at the end point. Text form `512:0.86/1024:0.93/4096:1`."""

    def __post_init__(self) -> None:
        rows = self.gemm_rows
        object.__setattr__(self, "gemm_rows", parse_gemm_rows(rows) if isinstance(rows, str)
                           else _checked_rows(rows))
        for fl in fields(self):
            if fl.name in ("name", "gemm_rows"):
                continue
            val = getattr(self, fl.name)
            if not isinstance(val, int | float) or isinstance(val, bool) or not val >= 0:
                raise ValueError(f"hardware {fl.name}={val!r} must be a number >= 0")
        for key in ("peak_flops", "tp_bandwidth", "pp_bandwidth", "host_bandwidth"):
            if getattr(self, key) <= 0:
                raise ValueError(f"hardware {key}={getattr(self, key)!r} must be > 0")
        if isinstance(self.node_gpus, float) or self.node_gpus < 1:
            raise ValueError(f"hardware node_gpus={self.node_gpus!r} must be an integer >= 1")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"hardware efficiency={self.efficiency!r} must be in (0, 1]")

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.efficiency

    def gemm_efficiency(self, rows: float) -> float:
        """Matmul efficiency at `rows` rows relative to large matmuls (`gemm_rows`)."""
        pts = self.gemm_rows
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, e0), (r1, e1) in zip(pts, pts[1:], strict=False):
            if rows <= r1:
                x = math.log2(rows / r0) / math.log2(r1 / r0)
                return e0 + x * (e1 - e0)
        return pts[-1][1]

    def chunk_efficiency(self, rows: float, chunks: int) -> float:
        """Matmul efficiency of a chunk of `rows / chunks` rows relative to the
        whole `rows` (at most 1: a smaller matmul is never faster per row)."""
        return min(1.0, self.gemm_efficiency(rows / chunks) / self.gemm_efficiency(rows))


def allreduce_time(num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `num_bytes` over `ranks` GPUs (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency + steps / ranks * num_bytes / bandwidth


def allgather_time(num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather whose result is `num_bytes` (each rank brings 1/`ranks`)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * num_bytes / bandwidth


def reduce_scatter_time(num_bytes: float, ranks: int, bandwidth: float,
                        latency: float) -> float:
    """Ring reduce-scatter of `num_bytes` (each rank keeps 1/`ranks` of the sum)."""
    return allgather_time(num_bytes, ranks, bandwidth, latency)


def p2p_time(num_bytes: float, bandwidth: float, latency: float) -> float:
    """One point-to-point send of `num_bytes`."""
    return latency + num_bytes / bandwidth
