"""Write a Scene as PNG through matplotlib (the `plot` extra: pip install -e ".[plot]").

matplotlib is imported only here and only when a PNG is asked for, so the
rest of stp.viz (SVG, traces) works without it.
"""

from __future__ import annotations

from pathlib import Path

from stp.viz.scene import Line, Poly, Rect, Scene, Text

__all__ = ["write_png"]

_DPI = 100.0


def _mpl():  # noqa: ANN202 - the module object
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ValueError(
            "PNG output needs matplotlib: pip install 'stp[plot]' (or write .svg, which needs "
            "nothing)"
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib import patheffects
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.patches import Polygon, Rectangle

    return plt, patheffects, LineCollection, PatchCollection, Polygon, Rectangle


def write_png(scene: Scene, path: str | Path, *, scale: float = 1.5) -> None:
    """Render `scene` to `path`; `scale` > 1 gives a sharper image of the same layout."""
    plt, patheffects, LineCollection, PatchCollection, Polygon, Rectangle = _mpl()
    w, h = scene.width, scene.height
    fig = plt.figure(figsize=(w / _DPI, h / _DPI), dpi=_DPI * scale)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.axis("off")
    fig.patch.set_facecolor(scene.background)
    pt = 72.0 / _DPI  # points per scene pixel
    # draw in scene order, batching runs of rectangles / lines for speed
    z = 0
    batch: list = []
    kind = None

    def flush() -> None:
        nonlocal batch, kind, z
        if not batch:
            return
        if kind == "rect":
            patches = [Rectangle((r.x, r.y), r.w, r.h) for r in batch]
            coll = PatchCollection(
                patches, match_original=False, zorder=z,
                facecolors=[r.fill or "none" for r in batch],
                edgecolors=[r.stroke or "none" for r in batch],
                linewidths=[r.stroke_width * pt if r.stroke else 0.0 for r in batch],
            )
            ax.add_collection(coll)
        else:
            segs = [((ln.x1, ln.y1), (ln.x2, ln.y2)) for ln in batch]
            styles = [(0, tuple(d * pt for d in ln.dash)) if ln.dash else "solid" for ln in batch]
            ax.add_collection(LineCollection(
                segs, colors=[ln.color for ln in batch],
                linewidths=[ln.width * pt for ln in batch], linestyles=styles, zorder=z,
            ))
        batch, kind = [], None
        z += 1

    for it in scene.items:
        k = "rect" if isinstance(it, Rect) else "line" if isinstance(it, Line) else None
        if k != kind:
            flush()
        if k is not None:
            kind = k
            batch.append(it)
        elif isinstance(it, Poly):
            if it.fill:
                ax.add_patch(Polygon(it.points, closed=True, facecolor=it.fill,
                                     edgecolor=it.color or "none",
                                     linewidth=it.width * pt if it.color else 0, zorder=z))
            else:
                xs, ys = zip(*it.points, strict=True)
                ax.plot(xs, ys, color=it.color, linewidth=it.width * pt, zorder=z)
            z += 1
        elif isinstance(it, Text):
            effects = ([patheffects.withStroke(linewidth=2.5 * pt, foreground=it.halo)]
                       if it.halo else None)
            ax.text(it.x, it.y, it.text, fontsize=it.size * pt, color=it.color,
                    ha={"start": "left", "middle": "center", "end": "right"}[it.anchor],
                    va="baseline", fontweight="bold" if it.bold else "normal",
                    path_effects=effects, zorder=z)
            z += 1
    flush()
    fig.savefig(str(path), dpi=_DPI * scale, facecolor=scene.background)
    plt.close(fig)
