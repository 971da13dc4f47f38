"""The geometry both timelines share (simulated, `timeline`; measured, `measured`):
one band per rank, top to bottom, its lanes stacked in it, time to scale along x,
tick lines across all bands and a time axis under them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from stp.sim.result import Span
from stp.viz import colors as C
from stp.viz.scene import Line, Rect, Scene, Text, fmt_num, nice_ticks, text_width

__all__ = ["Bands", "LEFT", "Legend", "TOP", "tp_kinds", "tp_rect"]

LEFT, RIGHT, TOP = 92.0, 24.0, 106.0
"""Margins: rank and lane labels on the left, the header above."""
LANE_COLORS = {"send": C.SEND_COLOR, "dp": C.DP_COLOR, "d2h": C.COPY_COLORS["D2H"],
               "h2d": C.COPY_COLORS["H2D"]}
"""The colour of a span in a lane other than compute and tp (tp: its collective's)."""
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

    def draw_thin_lanes(self, sc: Scene, band: int, rank: int,
                        spans: Mapping[tuple[int, str], Sequence[Span]],
                        tip: Callable[[Span], str]) -> None:
        """Rank `rank`'s spans (`spans[(rank, lane)]`) of every lane but compute, in
        `band`, at least a hairline wide, each with its tooltip."""
        for ln in self.lanes[1:]:
            y, h = self.lane_y(band, ln), self.lane_h[ln]
            for s in spans.get((rank, ln), []):
                x, w = self.x(s.start), max((s.end - s.start) * self.px, 0.6)
                if ln == "tp":
                    tp_rect(sc, x, y, w, h, s.kind, tip(s))
                else:
                    sc.add(Rect(x, y, w, h, fill=LANE_COLORS[ln], title=tip(s)))

    def draw_axis(self, sc: Scene, ticks: Sequence[float], caption: str) -> None:
        """The time axis under the bands, its ticks numbered, `caption` under it."""
        y = self.plot_bottom + 6
        sc.add(Line(LEFT, y, LEFT + self.plot_w, y, color=C.INK, width=1.0))
        for t in ticks:
            sc.add(Line(self.x(t), y, self.x(t), y + 5, color=C.INK, width=1.0))
            sc.add(Text(self.x(t), y + 17, fmt_num(t), size=10, color=C.INK, anchor="middle"))
        sc.add(Text(LEFT + self.plot_w / 2, y + 36, caption, size=11, color=C.MUTED,
                    anchor="middle"))


def tp_rect(sc: Scene, x: float, y: float, w: float, h: float, kind: str, tip: str) -> None:
    """A TP-lane span coloured by its collective (an `RS+AG` span: RS above, AG below)."""
    parts = C.tp_parts(kind)
    for i, part in enumerate(parts):
        sc.add(Rect(x, y + i * h / len(parts), w, h / len(parts), fill=C.TP_COLORS[part],
                    title=tip))


def tp_kinds(by_lane: dict[tuple[int, str], list[Span]], lane: str) -> list[str]:
    """The collectives the TP lanes hold, in legend order (AR, RS, AG)."""
    seen = {part for (_, ln), spans in by_lane.items() if ln == lane for s in spans
            for part in C.tp_parts(s.kind)}
    return [k for k in C.TP_COLORS if k in seen]


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
