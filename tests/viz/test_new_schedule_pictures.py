"""Pictures of braided DualPipeV: every F&B pair is drawn as one framed
block labelled `F mb|other mb`, the legend names braided blocks."""

from __future__ import annotations

import re
from collections import Counter

from stp.schedule import Block, generate
from stp.sim import Costs, simulate
from stp.viz import timeline_scene
from stp.viz.scene import Text


def _labels(scene) -> Counter:
    return Counter(e.text for e in scene.items
                   if isinstance(e, Text) and re.fullmatch(r"\d+\|\d+", e.text))


def test_dualpipev_pairs_drawn_as_blocks():
    sch = generate("dualpipev", 4, 8)
    scene = timeline_scene(simulate(sch, Costs(2, 2, 1, ar=0.4)))
    want = Counter(f"{a.passes[0].mb}|{a.passes[1].mb}"
                   for acts in sch.actions for a in acts if isinstance(a, Block))
    assert sum(want.values()) > 0
    assert _labels(scene) == want
    assert any(isinstance(e, Text) and e.text.startswith("braided block") for e in scene.items)
