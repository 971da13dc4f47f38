"""`stp draw --metrics`: training curves of one or more runs, read from their
`metrics.jsonl` (one step object per line, as `stp train --json` prints them).

Four panels against the step: loss (the held-out loss dashed, where the run
evaluated), learning rate, gradient norm before clipping, and tokens per second;
each run one colour, overlaid, named by its directory. A metrics file comes from
elsewhere: it is read with a size limit, a line that is not a step object is
refused naming the file and the line, and only the last line may be cut short (a
run killed mid-write).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stp.viz import colors as C
from stp.viz.scene import Line, Poly, Scene, Text, fmt_num, text_width

__all__ = ["RunCurves", "load_metrics", "curves_scene", "MAX_METRICS_BYTES"]

MAX_METRICS_BYTES = 256 * 2**20
"""A metrics file larger than this is refused (a million steps are about 300 MB)."""

PANELS = (("loss", "loss (held-out dashed)"), ("lr", "learning rate"),
          ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens / s"))
RUN_COLORS = ("#2f6db5", "#e07020", "#2e9e5b", "#c0392b", "#8a63b8", "#b8860b", "#3a8f8f",
              "#7f7f7f")


@dataclass
class RunCurves:
    """One run's figures by step, each a list of (step, value)."""

    name: str
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def add(self, key: str, step: int, value: object) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            self.series.setdefault(key, []).append((step, float(value)))


def _metrics_path(run: str | Path) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--metrics {str(run)!r}: no metrics.jsonl there (give a run "
                         "directory `stp train --out` wrote, or its metrics.jsonl)")
    return path


def load_metrics(run: str | Path) -> RunCurves:
    """The curves in a run directory's metrics.jsonl (or that file itself)."""
    path = _metrics_path(run)
    size = path.stat().st_size
    if size > MAX_METRICS_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than a metrics file holds "
                         f"({MAX_METRICS_BYTES} at most)")
    with path.open("rb") as f:
        text = f.read(MAX_METRICS_BYTES + 1).decode("utf-8", errors="replace")
    lines = text.split("\n")
    cut_short = lines.pop()  # "" when the file ends with a newline, as stp writes it
    name = path.parent.name if path.name == "metrics.jsonl" else path.stem
    curves = RunCurves(name or str(path))
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _row(line)
        if row is None:
            raise ValueError(f"{path}: line {number} is not a step object "
                             f"({line[:60]!r})")
        for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s"):
            if row:
                curves.add(key, row["step"], row.get(key))
    del cut_short  # a last line without its newline: a run killed mid-write
    if not curves.series:
        raise ValueError(f"{path}: no steps recorded")
    return curves


def _row(line: str) -> dict | None:
    """A step object, {} for a line to pass over (--json's closing summary), or
    None for a line that is neither."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    if row.get("summary") is True:
        return {}
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return row


def _ticks(lo: float, hi: float, target: int = 4) -> list[float]:
    """Round ticks covering [lo, hi]: steps of 1, 2, 2.5 or 5 x 10^k."""
    if hi <= lo:  # a flat series (a constant learning rate): centred in its panel
        half = abs(lo) / 2 or 1.0
        lo, hi = lo - half, hi + half
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    out = [first]
    while out[-1] < hi - 1e-12 * abs(hi):
        out.append(round(out[-1] + step, 12))
    return out


_PANEL_W, _PANEL_H, _GAP, _LEFT, _TOP = 400.0, 200.0, 80.0, 70.0, 70.0


def _panel(sc: Scene, x0: float, y0: float, title: str, runs: Sequence[RunCurves],
           keys: tuple[str, ...], steps: tuple[int, int]) -> None:
    values = [v for r in runs for k in keys for _, v in r.series.get(k, [])]
    sc.add(Text(x0, y0 - 10, title, size=12, bold=True, color=C.INK))
    if not values:
        sc.add(Text(x0 + _PANEL_W / 2, y0 + _PANEL_H / 2, "not recorded", size=11,
                    color=C.MUTED, anchor="middle"))
        return
    yt = _ticks(min(values), max(values))
    xt = _ticks(*steps, target=6)
    x_of = lambda s: x0 + (s - xt[0]) / (xt[-1] - xt[0] or 1) * _PANEL_W  # noqa: E731
    y_of = lambda v: y0 + _PANEL_H - (v - yt[0]) / (yt[-1] - yt[0] or 1) * _PANEL_H  # noqa: E731
    for t in yt:
        sc.add(Line(x0, y_of(t), x0 + _PANEL_W, y_of(t), color=C.GRID))
        sc.add(Text(x0 - 6, y_of(t) + 4, fmt_num(t), size=10, color=C.INK, anchor="end"))
    for t in xt:
        sc.add(Text(x_of(t), y0 + _PANEL_H + 15, fmt_num(t), size=10, color=C.INK,
                    anchor="middle"))
    sc.add(Line(x0, y0 + _PANEL_H, x0 + _PANEL_W, y0 + _PANEL_H, color=C.INK))
    for i, run in enumerate(runs):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        for k, key in enumerate(keys):
            pts = tuple((x_of(s), y_of(v)) for s, v in run.series.get(key, []))
            if len(pts) == 1:  # a single point still shows
                x, y = pts[0]
                pts = ((x - 2, y), (x + 2, y))
            if pts and k == 0:
                sc.add(Poly(pts, color=color, width=1.6))
            else:  # the held-out loss, dashed
                for a, b in zip(pts, pts[1:], strict=False):
                    sc.add(Line(*a, *b, color=color, width=1.6, dash=(5, 3)))


def curves_scene(runs: Sequence[RunCurves], title: str | None = None) -> Scene:
    """Loss, learning rate, gradient norm and tokens/s of `runs`, overlaid."""
    if not runs:
        raise ValueError("nothing to draw: no runs given")
    all_steps = [s for r in runs for pts in r.series.values() for s, _ in pts]
    steps = (min(all_steps), max(all_steps))
    width = 2 * (_LEFT + _PANEL_W) + 30 + 40  # room for the last x label
    height = _TOP + 2 * (_PANEL_H + _GAP) + 20
    sc = Scene(width, height)
    sc.add(Text(12, 24, title or "training curves", size=16, bold=True, color=C.INK))
    x = 12.0
    for i, run in enumerate(runs):  # the legend: one colour per run
        color = RUN_COLORS[i % len(RUN_COLORS)]
        sc.add(Line(x, 40, x + 18, 40, color=color, width=2.5))
        sc.add(Text(x + 22, 44, run.name, size=11, color=C.INK))
        x += 22 + text_width(run.name, 11) + 18
    for n, (key, label) in enumerate(PANELS):
        x0 = _LEFT + (n % 2) * (_PANEL_W + _LEFT + 30)
        y0 = _TOP + (n // 2) * (_PANEL_H + _GAP)
        keys = ("loss", "eval_loss") if key == "loss" else (key,)
        _panel(sc, x0, y0 + 10, label, runs, keys, steps)
        sc.add(Text(x0 + _PANEL_W / 2, y0 + _PANEL_H + 44, "step", size=10, color=C.MUTED,
                    anchor="middle"))
    return sc
