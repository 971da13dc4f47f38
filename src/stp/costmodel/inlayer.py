"""In-layer TP overlap priced from a model and a GPU: the `InLayer` plan a
chunked unit is timed with (`stp.sim.inlayer`, whose doc derives the unit's
timeline).

For a decoder cut with tensor parallelism t, sequence s and microbatch b:

    L   (what one more collective call costs)
          = tp_chunk_launch + (t - 1) tp_latency
        each of a unit's K chunked all-gathers (reduce-scatters) is a ring
        collective of 1/K of the bytes: K (t-1) latency steps and K launches
        instead of one of each, so K pieces cost the whole collective plus
        (K - 1) L (alpha-beta model, `stp.costmodel.hardware`)
    e   (a chunk's matmul efficiency relative to the whole)
          = gemm_efficiency(s b / K) / gemm_efficiency(s b)
        a chunk's matmuls have s b / K rows (the gathered tokens of one chunk)
        in place of s b; their efficiency falls as rows shrink (`gemm_rows`)

Times in milliseconds, as every decoder cost (`stp.costmodel.decoder.costs`).
At t = 1 there is nothing to overlap: the simulator leaves such units whole.
"""

from __future__ import annotations

from typing import Any

from stp.costmodel.hardware import HardwareSpec
from stp.sim.inlayer import InLayer

__all__ = ["in_layer_plan", "in_layer_for", "chunk_launch_ms", "CHUNK_CHOICES"]

CHUNK_CHOICES = (2, 4, 8)
"""The chunk counts the planner and the search try."""


def chunk_launch_ms(hardware: HardwareSpec, tp: int) -> float:
    """L of the module doc, milliseconds."""
    return (hardware.tp_chunk_launch + max(0, tp - 1) * hardware.tp_latency) * 1e3


def in_layer_plan(hardware: HardwareSpec, tp: int, tokens: int, chunks: int) -> InLayer:
    """The plan for `chunks` chunks of a microbatch of `tokens` rows (s b) on
    `hardware` with TP size `tp` (module doc)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r}: a microbatch's rows, an integer >= 1")
    return InLayer(chunks, chunk_launch_ms(hardware, tp),
                   hardware.chunk_efficiency(tokens, chunks))


def in_layer_for(spec: Any, hardware: HardwareSpec, chunks: int) -> InLayer | None:
    """The plan of a cost-model spec cut as it says (every family's spec has
    `tp`, `sequence`, `micro_batch`) at `chunks` chunks; None: off (0 chunks) or
    nothing to overlap (tp 1)."""
    if not chunks or spec.tp == 1:
        return None
    return in_layer_plan(hardware, spec.tp, spec.sequence * spec.micro_batch, chunks)
