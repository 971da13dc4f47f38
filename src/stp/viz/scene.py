"""A tiny vector scene: rectangles, lines, polylines and text in pixels.

The timeline and the comparison chart are laid out once as a `Scene`; the SVG
writer (no dependency) and the PNG writer (matplotlib) only translate these
primitives, so both files show exactly the same picture. Coordinates: x to
the right, y down, origin top left, sizes in pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Rect", "Line", "Poly", "Text", "Scene", "nice_ticks", "text_width", "fmt_num"]


@dataclass(frozen=True, slots=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str | None = None
    stroke: str | None = None
    stroke_width: float = 1.0
    title: str | None = None
    """Tooltip (SVG only)."""


@dataclass(frozen=True, slots=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    color: str = "#000000"
    width: float = 1.0
    dash: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Poly:
    """A polyline; closed and filled when `fill` is set."""

    points: tuple[tuple[float, float], ...]
    color: str | None = "#000000"
    width: float = 1.0
    fill: str | None = None


@dataclass(frozen=True, slots=True)
class Text:
    x: float
    y: float
    """Baseline of the text."""
    text: str
    size: float = 11.0
    color: str = "#000000"
    anchor: str = "start"
    """start, middle or end."""
    bold: bool = False
    halo: str | None = None
    """Outline colour drawn under the glyphs, to stay readable over stripes."""


Item = Rect | Line | Poly | Text


@dataclass
class Scene:
    width: float
    height: float
    items: list[Item] = field(default_factory=list)
    background: str = "#ffffff"

    def add(self, item: Item) -> None:
        self.items.append(item)


def text_width(text: str, size: float) -> float:
    """Estimated width of `text` in a sans-serif font (DejaVu Sans averages)."""
    narrow = sum(ch in "il.,;:|!' ()" for ch in text)
    return size * (0.64 * (len(text) - narrow) + 0.32 * narrow)


def nice_ticks(hi: float, target: int = 10) -> list[float]:
    """Round tick values from 0 to at least `hi`: steps of 1, 2 or 5 x 10^k."""
    if hi <= 0:
        return [0.0]
    raw = hi / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    n = int(math.floor(hi / step + 1e-9))
    return [round(i * step, 10) for i in range(n + 1)]


def fmt_num(x: float) -> str:
    """Short number for labels: 12, 12.5, 0.25, 1.2e+03."""
    return f"{x:.4g}"
