"""Pictures and traces of schedules: timelines (SVG/PNG), comparison charts,
Chrome/Perfetto traces. Imports no torch; matplotlib only for PNG output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stp.sim.result import SimResult
from stp.sim.trace_format import trace_events, trace_json, write_trace
from stp.viz.compare_plot import compare_scene
from stp.viz.curves import curves_scene, load_metrics
from stp.viz.measured import measured_scene
from stp.viz.measured_read import MeasuredTrace, load_measured_trace
from stp.viz.scene import Scene
from stp.viz.svg import to_svg
from stp.viz.timeline import timeline_scene

__all__ = [
    "draw_curves",
    "draw_timeline",
    "draw_measured",
    "load_measured_trace",
    "measured_scene",
    "plot_compare",
    "save_scene",
    "timeline_scene",
    "compare_scene",
    "curves_scene",
    "load_metrics",
    "to_svg",
    "trace_events",
    "trace_json",
    "write_trace",
]

_SUFFIXES = (".svg", ".png")


def save_scene(scene: Scene, path: str | Path) -> None:
    """Write `scene` as SVG or PNG, chosen by the file suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"cannot write {str(path)!r}: the file must end in .svg or .png")
    try:
        if suffix == ".svg":
            path.write_text(to_svg(scene), encoding="utf-8")
        else:
            from stp.viz.png import write_png

            write_png(scene, path)
    except OSError as e:
        raise ValueError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


def draw_timeline(res: SimResult, path: str | Path, *, title: str | None = None) -> None:
    """Draw the simulated timeline of `res` to an .svg or .png file."""
    save_scene(timeline_scene(res, title=title), path)


def draw_measured(trace: MeasuredTrace, path: str | Path, *, title: str | None = None) -> None:
    """Draw a measured trace (`stp train --trace`, read by load_measured_trace) to an
    .svg or .png file."""
    save_scene(measured_scene(trace, title=title), path)


def plot_compare(results: Sequence[SimResult], path: str | Path) -> None:
    """`stp compare --plot`: makespan / speed-up and peak memory per schedule."""
    save_scene(compare_scene(results), path)


def draw_curves(runs: Sequence[str | Path], path: str | Path, *, title: str | None = None) -> None:
    """`stp draw --metrics`: loss, learning rate, gradient norm and tokens/s of the
    runs (directories holding metrics.jsonl), overlaid, to an .svg or .png file."""
    save_scene(curves_scene([load_metrics(r) for r in runs], title=title), path)
