"""SVG and PNG writers, and the comparison chart."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from stp.schedule import generate
from stp.sim import Costs, simulate
from stp.viz import colors as C
from stp.viz import compare_scene, plot_compare, save_scene, to_svg
from stp.viz.scene import Line, Poly, Rect, Scene, Text, nice_ticks, text_width

NS = "{http://www.w3.org/2000/svg}"


def small_scene() -> Scene:
    sc = Scene(200, 100)
    sc.add(Rect(10, 10, 50, 20, fill=C.KIND_BASE["F"], title="a <b> & c"))
    sc.add(Rect(70, 10, 50, 20, stroke="#000000"))
    sc.add(Line(0, 50, 200, 50, dash=(4, 2)))
    sc.add(Poly(((0, 90), (50, 60), (100, 90)), fill="#cccccc", color=None))
    sc.add(Poly(((0, 95), (50, 70)), color="#444444"))
    sc.add(Text(100, 80, "7|3 <&>", halo="#ffffff"))
    return sc


def test_svg_is_well_formed_and_complete():
    root = ET.fromstring(to_svg(small_scene()))
    assert root.get("width") == "200" and root.get("height") == "100"
    assert len(root.findall(f"{NS}rect")) == 3  # background + two
    assert root.find(f"{NS}rect/{NS}title").text == "a <b> & c"
    assert root.find(f"{NS}line").get("stroke-dasharray") == "4 2"
    assert len(root.findall(f"{NS}polygon")) == 1 and len(root.findall(f"{NS}polyline")) == 1
    halo, text = root.findall(f"{NS}text")  # halo drawn as a stroked copy underneath
    assert halo.get("stroke") == "#ffffff" and text.get("stroke") is None
    assert text.text == "7|3 <&>"


def test_png_puts_pixels_where_the_scene_says(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = tmp_path / "s.png"
    save_scene(small_scene(), path)
    img = Image.open(path).convert("RGB")
    assert img.size == (300, 150)  # 1.5x the scene
    want = tuple(int(C.KIND_BASE["F"][i:i + 2], 16) for i in (1, 3, 5))
    got = img.getpixel((int(35 * 1.5), int(20 * 1.5)))
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 6
    assert img.getpixel((int(95 * 1.5), int(20 * 1.5))) == (255, 255, 255)  # unfilled frame


def test_save_scene_refuses_other_suffixes(tmp_path):
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        save_scene(small_scene(), tmp_path / "x.pdf")
    with pytest.raises(ValueError, match="cannot write"):
        save_scene(small_scene(), tmp_path / "no" / "such" / "dir.svg")


def test_nice_ticks_and_text_width():
    for hi in (0.3, 7, 77.6, 207.2, 1e4):
        t = nice_ticks(hi, 8)
        assert t[0] == 0 and t[-1] <= hi and hi - t[-1] < t[1] and 3 <= len(t) <= 17
    assert nice_ticks(0) == [0.0]
    assert text_width("10|2", 10) > text_width("1", 10) > 0


def test_compare_chart_bars_scale_with_makespan_and_memory(tmp_path):
    results = [simulate(generate(n, 4, 12), Costs(f=2, b=2, w=2, ar=0.4))
               for n in ("stp", "1f1b", "zb-v")]
    results.sort(key=lambda r: r.makespan)
    sc = compare_scene(results)
    bars = [it for it in sc.items if isinstance(it, Rect) and it.fill == C.KIND_BASE["F"]]
    assert len(bars) == 3
    ratio = [b.w / r.makespan for b, r in zip(bars, results, strict=True)]
    assert max(ratio) == pytest.approx(min(ratio))
    assert [b.y for b in bars] == sorted(b.y for b in bars)  # given order, top to bottom
    mem = [it for it in sc.items if isinstance(it, Rect) and it.fill == C.AR_COLOR]
    mratio = [b.w / max(r.peak_activation) for b, r in zip(mem, results, strict=True)]
    assert max(mratio) == pytest.approx(min(mratio))
    slowest = results[-1].makespan
    labels = {it.text for it in sc.items if isinstance(it, Text)}
    assert f"{results[0].makespan:.4g}  ({slowest / results[0].makespan:.2f}x)" in labels
    plot_compare(results, tmp_path / "c.svg")
    ET.parse(tmp_path / "c.svg")
    with pytest.raises(ValueError, match="no simulation results"):
        compare_scene([])
