"""The geometry both timelines share (simulated, `timeline`; measured, `measured`):
one band per rank, top to bottom, its lanes stacked in it, time to scale along x,
tick lines across all bands and a time axis under them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stp.viz import colors as C
from stp.viz.scene import Line, Rect, Scene, Text, fmt_num, nice_ticks, text_width

__all__ = ["Bands", "LEFT", "Legend", "TOP"]

LEFT, RIGHT, TOP = 92.0, 24.0, 106.0
"""Margins: rank and lane labels on the left, the header above."""
GAP, RANK_GAP = 3.0, 16.0
"""Between two lanes of a band; between two bands."""
PX_PER_SHORTEST = 18.0
"""Width of the shortest span, so a two-digit microbatch number fits in it."""


class Bands:
    """Where a span of lane `lane` of band `band` lies: `x(t)`, `lane_y(band, lane)`.
    `extra_h` is room under each band's lanes (the simulated memory strip)."""

    def __init__(self, lanes: Sequence[str], lane_h: Mapping[str, float], bands: int,
                 t_end: float, shortest: float, plot_width: float | None,
                 extra_h: float = 0.0) -> None:
        self.lanes, self.lane_h = list(lanes), lane_h
        self.t_end = t_end
        want = t_end / shortest * PX_PER_SHORTEST
        self.plot_w = plot_width or min(max(want, 800.0), 2800.0)
        self.px = self.plot_w / t_end
        self.band_h = sum(lane_h[ln] + GAP for ln in self.lanes) + extra_h
        self.width = LEFT + self.plot_w + RIGHT
        self.plot_bottom = TOP + bands * (self.band_h + RANK_GAP) - RANK_GAP
        self.height = self.plot_bottom + 52.0

    def x(self, t: float) -> float:
        return LEFT + t * self.px

    def lane_y(self, band: int, lane: str) -> float:
        """Top of `lane` in `band`; a name that is no lane: the room under them."""
        y = TOP + band * (self.band_h + RANK_GAP)
        for ln in self.lanes:
            if ln == lane:
                return y
            y += self.lane_h[ln] + GAP
        return y

    def ticks(self) -> list[float]:
        return nice_ticks(self.t_end, target=max(4, int(self.plot_w // 90)))

    def draw_lanes(self, sc: Scene, bands: int, ticks: Sequence[float]) -> None:
        """Every band's lane backgrounds, and the tick lines across them."""
        for band in range(bands):
            for ln in self.lanes:
                sc.add(Rect(LEFT, self.lane_y(band, ln), self.plot_w, self.lane_h[ln],
                            fill=C.LANE_BG))
        for t in ticks:
            sc.add(Line(self.x(t), TOP - 4, self.x(t), self.plot_bottom, color=C.GRID,
                        width=1.0))

    def draw_axis(self, sc: Scene, ticks: Sequence[float], caption: str) -> None:
        """The time axis under the bands, its ticks numbered, `caption` under it."""
        y = self.plot_bottom + 6
        sc.add(Line(LEFT, y, LEFT + self.plot_w, y, color=C.INK, width=1.0))
        for t in ticks:
            sc.add(Line(self.x(t), y, self.x(t), y + 5, color=C.INK, width=1.0))
            sc.add(Text(self.x(t), y + 17, fmt_num(t), size=10, color=C.INK, anchor="middle"))
        sc.add(Text(LEFT + self.plot_w / 2, y + 36, caption, size=11, color=C.MUTED,
                    anchor="middle"))


class Legend:
    """The header's row of swatches, each followed by its name, left to right."""

    SW, SH, FS = 14.0, 11.0, 11.0
    """Swatch width and height, name font size."""

    def __init__(self, sc: Scene, x: float, y: float) -> None:
        self.sc, self.x, self.y = sc, x, y

    def label(self, text: str) -> None:
        self.sc.add(Text(self.x, self.y + self.SH - 1, text, size=self.FS, color=C.INK))
        self.x += text_width(text, self.FS) + 16

    def swatch(self, fill: str, name: str, *, thin: bool = False) -> None:
        """A filled swatch (`thin`: a lane's height, for a collective or a copy), named."""
        if thin:
            self.sc.add(Rect(self.x, self.y + 3, self.SW, self.SH - 6, fill=fill))
        else:
            self.sc.add(Rect(self.x, self.y, self.SW, self.SH, fill=fill))
        self.x += self.SW + 4
        self.label(name)

    def frame(self, name: str) -> None:
        """The dark frame a braided block is drawn in, named."""
        self.sc.add(Rect(self.x, self.y, self.SW, self.SH, stroke=C.FRAME_COLOR,
                         stroke_width=1.4))
        self.x += self.SW + 4
        self.label(name)

    def tp_kinds(self, kinds: list[str]) -> None:
        """One thin swatch per TP collective drawn (AR, RS, AG, A2A)."""
        for kind in kinds:
            self.swatch(C.TP_COLORS[kind], C.TP_NAMES[kind], thin=True)

    def close(self) -> None:
        """Widen the scene to the row's end."""
        self.sc.width = max(self.sc.width, self.x + 12)
