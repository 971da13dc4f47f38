"""`stp compare --plot`: one row per schedule, makespan (with speed-up over the
slowest) on the left, peak activation memory (worst rank) on the right.

The dashed line in the makespan panel is the bubble-free time `m (f+b+w)`;
what a bar extends past it is pipeline and TP bubble.
"""

from __future__ import annotations

from collections.abc import Sequence

from stp.sim.result import SimResult
from stp.viz import colors as C
from stp.viz.scene import Line, Rect, Scene, Text, fmt_num, nice_ticks, text_width

__all__ = ["compare_scene"]

_ROW_H, _BAR_H, _PANEL_W, _TOP = 26.0, 16.0, 420.0, 78.0


def _panel(sc: Scene, x0: float, title: str, values: list[float], labels: list[str],
           color: str, marker: float | None, marker_label: str) -> None:
    n = len(values)
    hi = max([*values, marker or 0.0]) or 1.0
    ticks = nice_ticks(hi, target=5)
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + (ticks[1] - ticks[0] if len(ticks) > 1 else hi))
    plot_w = _PANEL_W - 100  # room right of the longest bar for its label
    px = plot_w / ticks[-1]
    bottom = _TOP + n * _ROW_H
    sc.add(Text(x0, _TOP - 12, title, size=12, bold=True, color=C.INK))
    for t in ticks:
        sc.add(Line(x0 + t * px, _TOP - 4, x0 + t * px, bottom, color=C.GRID))
        sc.add(Text(x0 + t * px, bottom + 15, fmt_num(t), size=10, color=C.INK, anchor="middle"))
    sc.add(Line(x0, bottom, x0 + plot_w, bottom, color=C.INK))
    for i, (val, lab) in enumerate(zip(values, labels, strict=True)):
        y = _TOP + i * _ROW_H + (_ROW_H - _BAR_H) / 2
        sc.add(Rect(x0, y, val * px, _BAR_H, fill=color, title=lab))
        sc.add(Text(x0 + val * px + 5, y + _BAR_H / 2 + 4, lab, size=10, color=C.INK))
    if marker is not None:
        sc.add(Line(x0 + marker * px, _TOP - 4, x0 + marker * px, bottom, color=C.PEAK_COLOR,
                    width=1.4, dash=(4, 3)))
        sc.add(Text(x0 + marker * px, bottom + 30, marker_label, size=10, color=C.PEAK_COLOR,
                    anchor="middle"))


def compare_scene(results: Sequence[SimResult]) -> Scene:
    """The comparison chart of `results` (in the given order, top to bottom)."""
    if not results:
        raise ValueError("nothing to plot: no simulation results")
    first = results[0]
    sch, c = first.schedule, first.costs
    names = [r.schedule.name for r in results]
    left = 20 + max(text_width(n, 12) for n in names) + 10
    width = left + 2 * _PANEL_W + 70 + 20
    height = _TOP + len(results) * _ROW_H + 60
    sc = Scene(width, height)
    sc.add(Text(12, 24, f"schedules at p={sch.num_ranks}, m={sch.num_microbatches}", size=16,
                bold=True, color=C.INK))
    sc.add(Text(12, 43, f"costs per microbatch and rank share: f={c.f:g} b={c.b:g} w={c.w:g} "
                f"ar={c.ar:g} comm={c.comm:g}, {first.layers} layer(s) per chunk; memory "
                f"M_B={first.mem.m_b:g}, M_W={first.mem.m_w:g}", size=11, color=C.MUTED))
    for i, n in enumerate(names):
        sc.add(Text(left - 10, _TOP + i * _ROW_H + _ROW_H / 2 + 4, n, size=12, color=C.INK,
                    anchor="end", bold=n == "stp"))
    slowest = max(r.makespan for r in results)
    ideal = sch.num_microbatches * (c.f + c.b + c.w)
    _panel(sc, left, "makespan (speed-up over the slowest)",
           [r.makespan for r in results],
           [f"{fmt_num(r.makespan)}  ({slowest / r.makespan:.2f}x)" for r in results],
           C.KIND_BASE["F"], ideal, f"no bubble: m(f+b+w) = {fmt_num(ideal)}")
    peaks = [max(r.peak_activation) for r in results]
    _panel(sc, left + _PANEL_W + 70, "peak activation memory, worst rank (M_B)", peaks,
           [fmt_num(p) for p in peaks], C.AR_COLOR, None, "")
    return sc
