"""Pictures of uneven stages: passes drawn as long as their stage runs, each
rank's memory curve on its own scale."""

from __future__ import annotations

import pytest

from stp.schedule import generate
from stp.sim import simulate
from stp.sim.layered import LayeredCosts
from stp.sim.stages import StageCost
from stp.viz import colors as C
from stp.viz import timeline_scene
from stp.viz.scene import Poly, Text
from stp.viz.timeline import _MEM_H, _Layout


def _result():
    model = LayeredCosts(StageCost(1, 1, 1, mem_b=0.25), last=StageCost(2, 2, 2, mem_b=2))
    return simulate(generate("1f1b", 3, 6), stages=model.table((1, 3, 2)))


def test_each_rank_memory_strip_reaches_its_own_top():
    res = _result()
    assert len({round(r.peak_activation, 9) for r in res.ranks}) == 3  # three peaks
    sc, layout = timeline_scene(res), _Layout(res, None)
    for r in range(3):
        top = layout.mem_y(r) + _MEM_H - (_MEM_H - 4)  # where the rank's peak is drawn
        lines = [it for it in sc.items if isinstance(it, Poly) and it.color == C.MEM_LINE
                 and layout.mem_y(r) <= it.points[0][1] <= layout.mem_y(r) + _MEM_H]
        assert len(lines) == 1
        assert min(y for _, y in lines[0].points) == pytest.approx(top)


def test_a_stage_with_more_layers_is_drawn_longer_and_the_header_names_the_partition():
    res = _result()
    sc, layout = timeline_scene(res), _Layout(res, None)
    fwd = {s.stage: s for s in res.spans if s.lane == "compute" and s.kind == "F" and s.mb == 0
           and s.unit == 0}
    width = {st: (s.end - s.start) * layout.px for st, s in fwd.items()}
    assert width[1] == pytest.approx(3 * width[0])
    header = [it.text for it in sc.items if isinstance(it, Text) and "per-stage" in it.text]
    assert header and "layers per stage 1,3,2" in header[0]
