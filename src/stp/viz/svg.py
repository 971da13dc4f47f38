"""Write a Scene as SVG text, with no dependency beyond the standard library."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from stp.viz.scene import Line, Poly, Rect, Scene, Text

__all__ = ["to_svg"]

_FONT = "DejaVu Sans, Verdana, Arial, Helvetica, sans-serif"


def _n(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _rect(it: Rect) -> str:
    attrs = f'x="{_n(it.x)}" y="{_n(it.y)}" width="{_n(max(it.w, 0))}" height="{_n(it.h)}"'
    attrs += f' fill="{it.fill or "none"}"'
    if it.stroke:
        attrs += f' stroke="{it.stroke}" stroke-width="{_n(it.stroke_width)}"'
    if it.title:
        return f"<rect {attrs}><title>{escape(it.title)}</title></rect>"
    return f"<rect {attrs}/>"


def _line(it: Line) -> str:
    dash = f' stroke-dasharray="{" ".join(_n(d) for d in it.dash)}"' if it.dash else ""
    return (f'<line x1="{_n(it.x1)}" y1="{_n(it.y1)}" x2="{_n(it.x2)}" y2="{_n(it.y2)}" '
            f'stroke="{it.color}" stroke-width="{_n(it.width)}"{dash}/>')


def _poly(it: Poly) -> str:
    pts = " ".join(f"{_n(x)},{_n(y)}" for x, y in it.points)
    if it.fill:
        stroke = f' stroke="{it.color}" stroke-width="{_n(it.width)}"' if it.color else ""
        return f'<polygon points="{pts}" fill="{it.fill}"{stroke}/>'
    return (f'<polyline points="{pts}" fill="none" stroke="{it.color}" '
            f'stroke-width="{_n(it.width)}"/>')


def _text(it: Text) -> str:
    attrs = (f'x="{_n(it.x)}" y="{_n(it.y)}" font-size="{_n(it.size)}" fill="{it.color}" '
             f'text-anchor="{it.anchor}"')
    if it.bold:
        attrs += ' font-weight="bold"'
    body = escape(it.text)
    if it.halo:
        # a stroked copy underneath rather than paint-order, which not every renderer knows
        under = attrs.replace(f'fill="{it.color}"', f'fill="{it.halo}"')
        return (f'<text {under} stroke="{it.halo}" stroke-width="2.5" '
                f'stroke-linejoin="round">{body}</text><text {attrs}>{body}</text>')
    return f"<text {attrs}>{body}</text>"


def to_svg(scene: Scene) -> str:
    """The SVG document of `scene`."""
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(scene.width)}" '
        f'height="{_n(scene.height)}" viewBox="0 0 {_n(scene.width)} {_n(scene.height)}" '
        f"font-family={quoteattr(_FONT)}>",
        f'<rect x="0" y="0" width="100%" height="100%" fill="{scene.background}"/>',
    ]
    for it in scene.items:
        if isinstance(it, Rect):
            out.append(_rect(it))
        elif isinstance(it, Line):
            out.append(_line(it))
        elif isinstance(it, Poly):
            out.append(_poly(it))
        else:
            out.append(_text(it))
    out.append("</svg>")
    return "\n".join(out) + "\n"
