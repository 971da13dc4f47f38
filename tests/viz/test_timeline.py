"""The timeline picture: what is drawn where, checked on the Scene itself."""

from __future__ import annotations

import pytest

from stp.schedule import Block, Kind, Pass, Schedule, generate, passes_of
from stp.sim import Costs, MemCosts, RankStats, SimResult, Span, simulate
from stp.viz import colors as C
from stp.viz import timeline_scene
from stp.viz.scene import Rect, Text
from stp.viz.timeline import _LANE_H, _Layout

F, B, W = Kind.F, Kind.B, Kind.W


def lane_rects(scene, layout, rank, lane="compute"):
    """Filled rectangles drawn on one lane (not its background)."""
    y = layout.lane_y(rank, lane)
    return [it for it in scene.items if isinstance(it, Rect) and it.fill and it.fill != C.LANE_BG
            and it.y >= y - 0.01 and it.y + it.h <= y + _LANE_H[lane] + 0.01]


def covered(rects, x):
    return any(r.x - 1e-6 <= x <= r.x + r.w + 1e-6 for r in rects)


def texts(scene):
    return [it.text for it in scene.items if isinstance(it, Text)]


@pytest.fixture(scope="module")
def stp_result():
    return simulate(generate("stp", 3, 9), Costs(f=2, b=2, w=2, ar=0.4, comm=0.1))


def test_every_unit_is_drawn_and_idle_gaps_stay_empty(stp_result):
    res = stp_result
    sc, L = timeline_scene(res), _Layout(res, None)
    for r in range(res.schedule.num_ranks):
        rects = lane_rects(sc, L, r)
        spans = sorted((s for s in res.spans if s.rank == r and s.lane == "compute"),
                       key=lambda s: s.start)
        for s in spans:
            assert covered(rects, L.x((s.start + s.end) / 2)), s
        # between two actions, where the rank computes nothing, nothing is drawn
        ends: dict[int, float] = {}
        starts: dict[int, float] = {}
        for s in spans:
            ends[s.action_index] = max(ends.get(s.action_index, 0.0), s.end)
            starts[s.action_index] = min(starts.get(s.action_index, 1e18), s.start)
        gaps = 0
        for i in sorted(ends)[:-1]:
            if starts[i + 1] - ends[i] > 0.05:
                gaps += 1
                assert not covered(rects, L.x((ends[i] + starts[i + 1]) / 2)), (r, i)
        assert gaps or r == 0


def test_braided_blocks_are_framed_and_labelled(stp_result):
    res = stp_result
    sc = timeline_scene(res, plot_width=4000)
    frames = [it for it in sc.items if isinstance(it, Rect) and it.fill is None
              and it.stroke == C.FRAME_COLOR and it.title]
    blocks = [a for acts in res.schedule.actions for a in acts if isinstance(a, Block)]
    assert len(frames) == len(blocks) > 0
    labels = set(texts(sc))
    for b in blocks:
        ps = passes_of(b)
        assert f"{ps[0].mb}|" + ",".join(str(p.mb) for p in ps[1:]) in labels


def test_microbatch_numbers_inside_lone_passes_when_they_fit():
    res = simulate(generate("1f1b", 2, 4), Costs(f=1, b=2, w=1))
    sc, L = timeline_scene(res), _Layout(res, None)
    for r in range(2):
        y = L.lane_y(r, "compute")
        inside = sorted((it.x, it.text) for it in sc.items
                        if isinstance(it, Text) and y < it.y < y + _LANE_H["compute"]
                        and it.x > L.x(0))
        spans = [s for s in res.spans if s.rank == r and s.lane == "compute"]
        want = []
        for idx in sorted({s.action_index for s in spans}):
            group = [s for s in spans if s.action_index == idx]
            t0, t1 = min(s.start for s in group), max(s.end for s in group)
            want.append((pytest.approx(L.x((t0 + t1) / 2)), str(group[0].mb)))
        assert inside == want


def test_memory_peak_marked_per_rank(stp_result):
    sc = timeline_scene(stp_result)
    peaks = [t for t in texts(sc) if t.startswith("peak ")]
    assert peaks == [f"peak {r.peak_activation:.4g} M_B" for r in stp_result.ranks]


def test_legend_follows_the_schedule():
    one = texts(timeline_scene(simulate(generate("1f1b", 2, 3))))
    assert "B+W full backward" in one and "B input grad" not in one
    assert "dark = chunk 0, light = chunk 1" not in one and "TP all-reduce" not in one
    two = texts(timeline_scene(simulate(generate("zb-v", 2, 4), Costs(ar=0.2))))
    assert "W weight grad" in two and "dark = chunk 0, light = chunk 1" in two
    assert "TP all-reduce" in two and "braided block (F mb | other mb)" not in two


def test_colours_distinct_by_kind_and_chunk():
    shades = {(k, c): C.pass_color(k, c, 2) for k in "FBW" for c in (0, 1)}
    assert len(set(shades.values())) == 6
    assert C.text_on("#ffffff") == "#000000" and C.text_on(C.KIND_BASE["F"]) == "#ffffff"


def test_hand_built_result_draws_without_the_simulator():
    """A fake SimResult: one rank, F0, a braided (F1;B0) block after an idle gap, B1."""
    sch = Schedule("fake", 1, 2, (0,), ((Pass(0, F, 0), Block((Pass(0, F, 1), Pass(0, B, 0))),
                                         Pass(0, B, 1)),))
    spans = [
        Span(0, "compute", 0.0, 1.0, "0F0", "F", 0, 0, 0, 0, 0, False),
        Span(0, "compute", 3.0, 3.5, "0F1", "F", 0, 1, 0, 0, 1, True),
        Span(0, "compute", 3.5, 4.0, "0I0", "B", 0, 0, 0, 0, 1, True),
        Span(0, "compute", 4.0, 5.0, "0I1", "B", 0, 1, 0, 0, 2, False),
        Span(0, "tp", 3.5, 3.7, "0F1", "AR", 0, 1, 0, 0, 1, True),
    ]
    res = SimResult(sch, Costs(), MemCosts(), 1, 5.0, [RankStats(0, 0.0, 5.0, 3.0, 0.0, 2.0)],
                    spans, [[(0.0, 1.0), (3.0, 2.0), (4.0, 1.0), (5.0, 0.0)]])
    sc, L = timeline_scene(res), _Layout(res, None)
    rects = lane_rects(sc, L, 0)
    assert not covered(rects, L.x(2.0))  # the idle gap
    fills = {round(r.x - L.x(0), 3): r.fill for r in rects}
    assert fills[0.0] == C.pass_color("F", 0, 1)
    assert fills[round(3.5 * L.px, 3)] == C.pass_color("B", 0, 1)
    assert len(lane_rects(sc, L, 0, "tp")) == 1
    assert "peak 2 M_B" in texts(sc) and "1|0" in texts(sc)


def test_large_pipelines_stay_bounded_and_refuse_empty_results():
    res = simulate(generate("stp", 8, 32), Costs(f=2, b=2, w=2, ar=0.4))
    sc = timeline_scene(res)
    assert sc.width < 3200 and sc.height < 1000
    sizes = [it.size for it in sc.items if isinstance(it, Text)]
    assert min(sizes) >= 7
    empty = simulate(generate("1f1b", 2, 2), record_spans=False)
    with pytest.raises(ValueError, match="record_spans"):
        timeline_scene(empty)
