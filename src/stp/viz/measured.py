"""A measured trace drawn as a timeline (`stp draw --measured TRACE.json --out FILE.svg`).

One band per global rank, top to bottom: the compute lane (every unit as the
runtime ran it, F / B / W in the simulated picture's colours, a braided
block's units framed together and labelled `F-mb|other-mb`), the TP lane
(each collective in its colour: all-reduce, and under sequence parallelism
the reduce-scatter that ends a unit and the all-gather that starts one), and
the send lane (sends and receives) and the DP lane (each stage's gradient
reduction over the data-parallel replicas, from its launch to its
completion: under the compute of the passes after that stage's last W when
the overlap is on). Times are the measured milliseconds. A
TP span drawn under a unit of the other pass of its block is communication
hidden by braiding (STP paper, arXiv 2510.27257, Fig. 3); the header counts,
per kind, how much of the collectives' time ran under the rank's compute.
No memory strip: a trace holds no activation memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from stp.sim.result import Span
from stp.viz import colors as C
from stp.viz.bands import LEFT, Bands, Legend, tp_kinds
from stp.viz.measured_read import MeasuredTrace
from stp.viz.scene import Line, Rect, Scene, Text, fmt_num, text_width

__all__ = ["measured_scene", "hidden_under_compute"]

_LANES = ("compute", "tp", "send", "dp")
_LANE_H = {"compute": 26.0, "tp": 9.0, "send": 6.0, "dp": 6.0}


def hidden_under_compute(spans: Sequence[Span], rank: int, kind: str) -> tuple[float, float]:
    """(total time, time under the rank's compute spans) of the rank's tp spans of
    `kind` (or with kind "dp" its DP gradient reductions): how much of that
    collective ran while the stream computed."""
    busy = sorted((s.start, s.end) for s in spans if s.rank == rank and s.lane == "compute")
    total = hidden = 0.0
    for s in spans:
        if s.rank != rank:
            continue
        if not (s.lane == "dp" if kind == "dp" else
                s.lane == "tp" and kind in C.tp_parts(s.kind)):
            continue
        total += s.end - s.start
        hidden += sum(max(0.0, min(s.end, b) - max(s.start, a)) for a, b in busy
                      if a < s.end and b > s.start)
    return total, hidden


class _Layout(Bands):
    def __init__(self, trace: MeasuredTrace, plot_width: float | None) -> None:
        self.ranks = sorted({s.rank for s in trace.spans})
        self.by_lane: dict[tuple[int, str], list[Span]] = defaultdict(list)
        for s in trace.spans:
            self.by_lane[(s.rank, s.lane)].append(s)
        lanes = [ln for ln in _LANES if ln == "compute" or any(
            self.by_lane.get((r, ln)) for r in self.ranks)]
        t_end = max(s.end for s in trace.spans) or 1.0
        units = [s.end - s.start for s in trace.spans if s.lane == "compute" and s.end > s.start]
        super().__init__(lanes, _LANE_H, len(self.ranks), t_end, min(units, default=t_end),
                         plot_width)


def measured_scene(trace: MeasuredTrace, *, title: str | None = None,
                   plot_width: float | None = None) -> Scene:
    """The picture of a measured trace (stp.viz.measured_read)."""
    L = _Layout(trace, plot_width)
    sc = Scene(L.width, L.height)
    sc.add(Text(12, 24, title or f"{trace.schedule} (measured): {len(L.ranks)} ranks",
                size=16, bold=True, color=C.INK))
    for i, line in enumerate(_summary(trace, L)):
        sc.add(Text(12, 42 + 15 * i, line, size=11, color=C.MUTED))
        sc.width = max(sc.width, 24 + text_width(line, 11))
    _legend(sc, L, trace)
    ticks = L.ticks()
    L.draw_lanes(sc, len(L.ranks), ticks)
    for band, r in enumerate(L.ranks):
        for ln in L.lanes[1:]:
            sc.add(Text(LEFT - 8, L.lane_y(band, ln) + _LANE_H[ln] - 0.5,
                        {"tp": "TP", "send": "send", "dp": "DP"}[ln], size=8, color=C.MUTED,
                        anchor="end"))
        sc.add(Text(LEFT - 8, L.lane_y(band, "compute") + 17, f"rank {r}", size=12,
                    bold=True, color=C.INK, anchor="end"))
    for band, r in enumerate(L.ranks):
        _compute(sc, L, trace, band, r)
        L.draw_thin_lanes(sc, band, r, L.by_lane,
                          lambda s: f"{s.kind} of {s.name} {s.start:.3f}-{s.end:.3f} ms")
    L.draw_axis(sc, ticks, "time (ms, measured)")
    return sc


def _summary(trace: MeasuredTrace, L: _Layout) -> list[str]:
    lines = [f"measured by the stp runtime: {len(trace.spans)} spans, last one ends at "
             f"{fmt_num(L.t_end)} ms"]
    parts = []
    for kind in tp_kinds(L.by_lane, "tp"):
        total = hidden = 0.0
        for r in L.ranks:
            t, h = hidden_under_compute(trace.spans, r, kind)
            total, hidden = total + t, hidden + h
        share = hidden / total if total > 0 else 0.0
        parts.append(f"{kind} {fmt_num(total)} ms ({share:.0%} under compute)")
    if parts:
        lines.append("TP collectives, all ranks: " + ", ".join(parts))
    for what, kinds in (("DP gradient reductions", ("DP-AR", "DP-RS")),
                        ("DP parameter all-gathers", ("DP-AG",))):
        spans = [s for s in trace.spans if s.lane != "dp" or s.kind in kinds]
        dp = [s for s in spans if s.lane == "dp"]
        if dp:
            total = sum(s.end - s.start for s in dp)
            hidden = sum(hidden_under_compute(spans, r, "dp")[1] for r in L.ranks)
            share = hidden / total if total > 0 else 0.0
            lines.append(f"{what}, all ranks: {fmt_num(total)} ms "
                         f"({share:.0%} under compute)")
    return lines


def _legend(sc: Scene, L: _Layout, trace: MeasuredTrace) -> None:
    leg = Legend(sc, 12.0, 80.0)
    kinds = {s.kind for s in trace.spans if s.lane == "compute"}
    for kind, name in (("F", "F forward"), ("B", "B input grad"), ("W", "W weight grad")):
        if kind in kinds:
            leg.swatch(C.pass_color(kind, 0, 1), name)
    if any(s.braided for s in trace.spans if s.lane == "compute"):
        leg.frame("braided block (F mb | other mb)")
    leg.tp_kinds(tp_kinds(L.by_lane, "tp"))
    if "send" in L.lanes:
        leg.swatch(C.SEND_COLOR, "send / receive", thin=True)
    if "dp" in L.lanes:
        gathers = any(s.kind == "DP-AG" for s in trace.spans if s.lane == "dp")
        leg.swatch(C.DP_COLOR, "DP gradient reduction / parameter all-gather" if gathers
                   else "DP gradient reduction", thin=True)
    leg.close()


def _compute(sc: Scene, L: _Layout, trace: MeasuredTrace, band: int, r: int) -> None:
    y, h = L.lane_y(band, "compute"), _LANE_H["compute"]
    groups: dict[int, list[Span]] = defaultdict(list)
    for s in L.by_lane.get((r, "compute"), []):
        groups[s.action_index].append(s)
    for idx, spans in sorted(groups.items()):
        name = trace.actions.get((r, idx), spans[0].name)
        for s in spans:
            sc.add(Rect(L.x(s.start), y, max((s.end - s.start) * L.px, 0.4), h,
                        fill=C.pass_color(s.kind, s.chunk, trace.chunks),
                        title=f"{name}: {s.kind} of {s.name} unit {s.unit} "
                        f"{s.start:.3f}-{s.end:.3f} ms"))
        t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
        mbs = list(dict.fromkeys(s.mb for s in spans))
        if any(s.braided for s in spans):
            sc.add(Rect(L.x(t0), y + 0.7, (t1 - t0) * L.px, h - 1.4, stroke=C.FRAME_COLOR,
                        stroke_width=1.4, title=f"{name} {t0:.3f}-{t1:.3f} ms"))
        text = "|".join(map(str, mbs))
        if text_width(text, 9) <= (t1 - t0) * L.px - 2:
            sc.add(Text((L.x(t0) + L.x(t1)) / 2, y + h / 2 + 3.2, text, size=9, color=C.INK,
                        anchor="middle", halo="#ffffff"))
        sc.add(Line(L.x(t0), y, L.x(t0), y + h, color="#ffffff", width=0.8))
