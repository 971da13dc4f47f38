"""Lay out a simulated timeline (`SimResult`) as a Scene.

One band per rank, top to bottom: the compute lane (F / B / W blocks, the
rank's chunks in shades of one hue, microbatch numbers where they fit), the
TP lane (all-reduces; under sequence parallelism reduce-scatters and
all-gathers, each in its own colour), the send lane and the offload copy lanes when the run
has them, and the rank's resident activation memory over time with its peak
marked. A braided block (STP, arXiv 2510.27257, Fig. 3) is drawn unit by unit, so its
interleaving is visible, inside one dark frame labelled `F-mb|other-mb`.
Times are to scale, so stages of different cost (a per-stage cost table:
uneven layer partitions, the embedding and the output layer) are drawn as
long as they run; each rank's memory strip has its own scale (its peak at
the top), so a light rank's curve stays readable next to a heavy one.
Idle time is left empty; a gap inside a lone pass is its wait on a TP
all-reduce.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from stp.schedule.ir import Kind, passes_of
from stp.sim.result import SimResult, Span
from stp.viz import colors as C
from stp.viz.bands import LEFT, Bands, Legend, tp_kinds
from stp.viz.scene import Line, Poly, Rect, Scene, Text, fmt_num, text_width

__all__ = ["timeline_scene"]

_LANE_H = {"compute": 26.0, "tp": 9.0, "send": 6.0, "d2h": 6.0, "h2d": 6.0}
_LANE_NAME = {"compute": "", "tp": "TP", "send": "send", "d2h": "D2H", "h2d": "H2D"}
_MEM_H = 30.0
_EPS = 1e-9


def _pass_kind(kind: Kind) -> str:
    return {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "BW"}[kind]


def _segments(spans: Sequence[Span]) -> list[tuple[float, float]]:
    """Merge touching unit spans of one lone pass into contiguous segments."""
    segs: list[tuple[float, float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if segs and s.start <= segs[-1][1] + _EPS:
            segs[-1] = (segs[-1][0], max(segs[-1][1], s.end))
        else:
            segs.append((s.start, s.end))
    return segs


def _shortest_pass(res: SimResult) -> float:
    """The shortest F, B or W pass of any stage (what the width is fitted to)."""
    if res.stages is not None:
        return min((x for s in res.stages.stages for x in (s.f, s.b, s.w) if x > 0),
                   default=1.0)
    c = res.costs
    return min((x for x in (c.f, c.b, c.w) if x > 0), default=1.0) / res.schedule.chunks


class _Layout(Bands):
    def __init__(self, res: SimResult, plot_width: float | None) -> None:
        self.res = res
        sch = res.schedule
        self.v = sch.chunks
        self.by_lane: dict[tuple[int, str], list[Span]] = defaultdict(list)
        for s in res.spans:
            self.by_lane[(s.rank, s.lane)].append(s)
        lanes = ["compute"] + [
            ln for ln in ("tp", "send", "d2h", "h2d")
            if any(self.by_lane.get((r, ln)) for r in range(sch.num_ranks))
        ]
        t_end = max([res.makespan, *(s.end for s in res.spans)]) or 1.0
        shortest = _shortest_pass(res)
        super().__init__(lanes, _LANE_H, sch.num_ranks, t_end, shortest, plot_width,
                         extra_h=_MEM_H)
        self.font = 10.0 if shortest * self.px >= 16 else 9.0

    def mem_y(self, rank: int) -> float:
        return self.lane_y(rank, "memory")


def timeline_scene(
    res: SimResult, *, title: str | None = None, plot_width: float | None = None
) -> Scene:
    """The picture of `res` (needs spans: simulate with record_spans=True)."""
    if not res.spans:
        raise ValueError("the simulation result has no spans; simulate with record_spans=True")
    L = _Layout(res, plot_width)
    sc = Scene(L.width, L.height)
    _header(sc, L, title)
    ticks = L.ticks()
    L.draw_lanes(sc, res.schedule.num_ranks, ticks)
    for r in range(res.schedule.num_ranks):
        _rank_labels(sc, L, r)
        _compute_lane(sc, L, r)
        L.draw_thin_lanes(sc, r, r, L.by_lane, lambda s: f"{s.kind} of {s.name} "
                          f"{fmt_num(s.start)}-{fmt_num(s.end)}")
        _memory(sc, L, r)
    L.draw_axis(sc, ticks, "time (units of the --cost inputs)")
    return sc


def _header(sc: Scene, L: _Layout, title: str | None) -> None:
    res, sch = L.res, L.res.schedule
    overlap = "" if res.mode == "braided" else f", tp overlap {res.mode}" + (
        f" K={res.in_layer.chunks}" if res.in_layer else "")
    sc.add(Text(12, 24, title or f"{sch.name}: p={sch.num_ranks}, m={sch.num_microbatches}, "
                f"v={sch.chunks}{overlap}", size=16, bold=True, color=C.INK))
    crit = res.critical_rank
    peak_rank = max(res.ranks, key=lambda r: r.peak_activation)
    lines = [
        _costs_line(res),
        f"makespan {fmt_num(res.makespan)}, bubble rate {res.bubble_rate:.1%} (rank "
        f"{crit.rank}), PP bubble {fmt_num(res.pp_bubble)}, TP bubble {fmt_num(res.tp_bubble)}, "
        f"peak activation {fmt_num(peak_rank.peak_activation)} M_B (rank {peak_rank.rank})",
    ]
    for i, line in enumerate(lines):
        sc.add(Text(12, 42 + 15 * i, line, size=11, color=C.MUTED))
        sc.width = max(sc.width, 12 + text_width(line, 11) + 12)
    _legend(sc, L, 12.0, 80.0)


def _costs_line(res: SimResult) -> str:
    c = res.costs
    if res.stages is None:
        return (f"costs per microbatch and rank share: f={c.f:g} b={c.b:g} w={c.w:g} "
                f"ar={c.ar:g} comm={c.comm:g}; {res.layers} layer(s) per chunk; memory "
                f"M_B={res.mem.m_b:g} M_W={res.mem.m_w:g}")
    st = res.stages
    times = " ".join(f"{s.f + s.b + s.w:.3g}" for s in st.stages[:12])
    more = " ..." if st.num_stages > 12 else ""
    part = "" if st.partition is None else (
        "; layers per stage " + ",".join(map(str, st.partition[:24]))
        + (",..." if st.num_stages > 24 else ""))
    return f"per-stage costs, f+b+w of each stage: {times}{more}; comm={st.comm:g}{part}"


def _legend(sc: Scene, L: _Layout, x: float, y: float) -> None:
    sch = L.res.schedule
    kinds = {p.kind for r in range(sch.num_ranks) for p in sch.passes(r)}
    braided = any(s.braided for s in L.res.spans)
    leg = Legend(sc, x, y)
    sw, sh = leg.SW, leg.SH
    for kind, key, name in ((Kind.F, "F", "F forward"), (Kind.B, "B", "B input grad"),
                            (Kind.W, "W", "W weight grad"), (Kind.BW, "B", "B+W full backward")):
        if kind not in kinds:
            continue
        for ch in range(L.v):  # one swatch per chunk shade
            sc.add(Rect(leg.x, y, sw, sh, fill=C.pass_color(key, ch, L.v)))
            if kind is Kind.BW:
                sc.add(Rect(leg.x, y + sh * 0.65, sw, sh * 0.35,
                            fill=C.pass_color("W", ch, L.v)))
            leg.x += sw + 1
        leg.x += 4
        leg.label(name)
    if braided:
        sc.add(Rect(leg.x, y, sw / 2, sh, fill=C.pass_color("F", 0, 1)))
        sc.add(Rect(leg.x + sw / 2, y, sw / 2, sh, fill=C.pass_color("B", 0, 1)))
        leg.frame("braided block (F mb | other mb)")
    leg.tp_kinds(tp_kinds(L.by_lane, "tp"))
    extra = [("send", C.SEND_COLOR, "send"),
             ("d2h", C.COPY_COLORS["D2H"], "offload D2H"),
             ("h2d", C.COPY_COLORS["H2D"], "reload H2D")]
    for lane, color, name in extra:
        if lane in L.lanes:
            leg.swatch(color, name, thin=True)
    if "tp" in L.lanes:
        leg.swatch(C.tp_wait(C.KIND_BASE["F"]), "pale: pass waits on its all-reduce")
    sc.add(Rect(leg.x, y, sw, sh, fill=C.MEM_FILL, stroke=C.MEM_LINE, stroke_width=1.0))
    leg.x += sw + 4
    leg.label("activation memory (peak marked)")
    if L.v == 2:
        leg.label("dark = chunk 0, light = chunk 1")
    elif L.v > 2:
        leg.label("darker = earlier chunk")
    leg.close()


def _rank_labels(sc: Scene, L: _Layout, r: int) -> None:
    y = L.lane_y(r, "compute")
    sc.add(Text(LEFT - 8, y + _LANE_H["compute"] / 2 + 4, f"rank {r}", size=12, bold=True,
                color=C.INK, anchor="end"))
    for ln in L.lanes[1:]:
        sc.add(Text(LEFT - 8, L.lane_y(r, ln) + _LANE_H[ln] - 0.5, _LANE_NAME[ln], size=8,
                    color=C.MUTED, anchor="end"))
    sc.add(Text(LEFT - 8, L.mem_y(r) + _MEM_H / 2 + 3, "memory", size=8, color=C.MUTED,
                anchor="end"))


def _label(sc: Scene, L: _Layout, x0: float, x1: float, y: float, h: float, text: str,
           fill: str | None) -> None:
    size = next((f for f in (L.font, L.font * 0.8) if text_width(text, f) <= x1 - x0 - 2), None)
    if size is None:
        return  # too narrow: the SVG tooltip and the trace still name it
    color = C.text_on(fill) if fill else C.INK
    sc.add(Text((x0 + x1) / 2, y + h / 2 + size * 0.36, text, size=size, color=color,
                anchor="middle", halo="#ffffff" if fill is None else None))


def _compute_lane(sc: Scene, L: _Layout, r: int) -> None:
    sch, v = L.res.schedule, L.v
    y, h = L.lane_y(r, "compute"), _LANE_H["compute"]
    by_action: dict[int, list[Span]] = defaultdict(list)
    for s in L.by_lane.get((r, "compute"), []):
        by_action[s.action_index].append(s)
    for idx, spans in sorted(by_action.items()):
        action = sch.actions[r][idx]
        ps = passes_of(action)
        if len(ps) > 1:
            for s in spans:
                sc.add(Rect(L.x(s.start), y, (s.end - s.start) * L.px, h,
                            fill=C.pass_color(s.kind, s.chunk, v),
                            title=f"{action}: {s.name} unit {s.unit}"))
            t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
            sc.add(Rect(L.x(t0), y + 0.7, (t1 - t0) * L.px, h - 1.4, stroke=C.FRAME_COLOR,
                        stroke_width=1.4, title=f"{action} {fmt_num(t0)}-{fmt_num(t1)}"))
            text = f"{ps[0].mb}|" + ",".join(str(p.mb) for p in ps[1:])
            _label(sc, L, L.x(t0), L.x(t1), y, h, text, None)
            continue
        p = ps[0]
        key = {"BW": "B"}.get(_pass_kind(p.kind), _pass_kind(p.kind))
        fill = C.pass_color(key, sch.chunk_of(p.stage), v)
        segs = _segments(spans)
        t_lo, t_hi = segs[0][0], segs[-1][1]
        if len(segs) > 1:  # the pass waits on its own all-reduces in between: pale
            sc.add(Rect(L.x(t_lo), y, (t_hi - t_lo) * L.px, h, fill=C.tp_wait(fill),
                        title=f"{p} waiting on its TP all-reduce"))
        for t0, t1 in segs:
            tip = f"{p}: {_pass_kind(p.kind)} stage {p.stage} mb {p.mb} {fmt_num(t0)}-{fmt_num(t1)}"
            sc.add(Rect(L.x(t0), y, (t1 - t0) * L.px, h, fill=fill, title=tip))
            if p.kind is Kind.BW:
                sc.add(Rect(L.x(t0), y + h * 0.7, (t1 - t0) * L.px, h * 0.3,
                            fill=C.pass_color("W", sch.chunk_of(p.stage), v)))
        # centred on the whole pass; where it is split, the centre is a pale wait
        under = fill if len(segs) == 1 else C.tp_wait(fill)
        _label(sc, L, L.x(t_lo), L.x(t_hi), y, h * (0.7 if p.kind is Kind.BW else 1.0),
               str(p.mb), under)
        # a white hairline where a pass starts, so back-to-back passes of one colour separate
        sc.add(Line(L.x(t_lo), y, L.x(t_lo), y + h, color="#ffffff", width=0.8))


def _memory(sc: Scene, L: _Layout, r: int) -> None:
    y0 = L.mem_y(r)
    base = y0 + _MEM_H
    # each rank its own scale: its peak reaches the top of its strip
    scale = (_MEM_H - 4) / (L.res.ranks[r].peak_activation or 1.0)
    pts: list[tuple[float, float]] = [(L.x(0), base)]
    cur = 0.0
    for t, val in L.res.memory[r]:
        if len(pts) > 1 and abs(L.x(t) - pts[-1][0]) < 0.05:
            pts[-1] = (pts[-1][0], base - val * scale)  # same instant: keep the last value
            cur = val
            continue
        pts.append((L.x(t), base - cur * scale))
        pts.append((L.x(t), base - val * scale))
        cur = val
    pts.append((L.x(L.t_end), base - cur * scale))
    sc.add(Poly(tuple(pts) + ((L.x(L.t_end), base),), color=None, fill=C.MEM_FILL))
    sc.add(Poly(tuple(pts), color=C.MEM_LINE, width=1.0))
    sc.add(Line(L.x(0), base, L.x(L.t_end), base, color="#bbbbbb", width=0.8))
    peak = L.res.ranks[r].peak_activation
    hit = next((t for t, val in L.res.memory[r] if val >= peak - 1e-9), None)
    if hit is None or peak <= 0:
        return
    px, py = L.x(hit), base - peak * scale
    sc.add(Poly(((px - 4, py - 6), (px + 4, py - 6), (px, py)), color=None, fill=C.PEAK_COLOR))
    text = f"peak {fmt_num(peak)} M_B"
    right = px + 6 + text_width(text, 9) < LEFT + L.plot_w
    # inside the strip, under the curve's top, so the curve never crosses the text
    sc.add(Text(px + 6 if right else px - 6, base - 4, text, size=9, color=C.PEAK_COLOR,
                anchor="start" if right else "end", bold=True))
