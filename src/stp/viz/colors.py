"""Colours of the pictures: one hue per pass kind, one shade per chunk.

F blue, B (input gradient) orange, W green, as in the Zero Bubble and STP
papers' figures; a rank's first chunk is the dark shade and later chunks get
lighter, so the two arms of a V schedule read apart at a glance.
Colour-blind safe hues (Okabe-Ito family).
"""

from __future__ import annotations

__all__ = [
    "KIND_BASE",
    "pass_color",
    "tp_wait",
    "text_on",
    "AR_COLOR",
    "TP_COLORS",
    "TP_NAMES",
    "tp_parts",
    "SEND_COLOR",
    "DP_COLOR",
    "COPY_COLORS",
    "MEM_LINE",
    "MEM_FILL",
    "PEAK_COLOR",
    "FRAME_COLOR",
    "LANE_BG",
    "GRID",
    "INK",
    "MUTED",
]

KIND_BASE = {"F": "#2f6db5", "B": "#e07020", "W": "#2e9e5b"}
"""Dark shade (chunk 0) of each compute kind."""

AR_COLOR = "#8a63b8"
TP_COLORS = {"AR": AR_COLOR, "RS": "#c2449a", "AG": "#3a8f8f", "A2A": "#b8860b"}
"""The TP lane by collective: all-reduce purple; under sequence parallelism
(arXiv 2205.05198) the reduce-scatter that ends a unit magenta, the all-gather
that starts one teal; an expert-parallel MoE layer's all-to-all (dispatch or
combine, stp.models.moe.dispatch) dark gold."""
TP_NAMES = {"AR": "TP all-reduce", "RS": "reduce-scatter (RS)", "AG": "all-gather (AG)",
            "A2A": "expert all-to-all (A2A)"}
SEND_COLOR = "#7f7f7f"
DP_COLOR = "#2e7d32"
"""Data-parallel gradient reductions (the dp lane of a measured trace)."""
COPY_COLORS = {"D2H": "#b5651d", "H2D": "#1d8fb5"}
MEM_LINE = "#444444"
MEM_FILL = "#d9d9d9"
PEAK_COLOR = "#c0392b"
FRAME_COLOR = "#111111"
LANE_BG = "#f3f3f3"
GRID = "#e2e2e2"
INK = "#222222"
MUTED = "#666666"


def _mix(color: str, other: str, t: float) -> str:
    a = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    b = [int(other[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b, strict=True))


def pass_color(kind: str, chunk: int, chunks: int) -> str:
    """Fill of a compute block: `kind` in F/B/W, chunk 0 darkest."""
    base = KIND_BASE[kind]
    if chunks <= 1:
        return base
    return _mix(base, "#ffffff", 0.55 * chunk / (chunks - 1))


def tp_parts(kind: str) -> list[str]:
    """The collectives of a TP-lane span's kind: `RS+AG` (the simulator's reduce-scatter
    followed by the next unit's all-gather, one span) is both; unknown kinds draw as
    an all-reduce."""
    parts = [k for k in kind.split("+") if k in TP_COLORS]
    return parts or ["AR"]


def tp_wait(fill: str) -> str:
    """Pale version of a pass colour: the pass is stalled on its own TP all-reduce."""
    return _mix(fill, "#ffffff", 0.72)


def text_on(fill: str) -> str:
    """Black or white, whichever reads better on `fill`."""
    r, g, b = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "#ffffff"
