"""In-layer TP overlap in the simulator: the chunked timeline against hand counts."""

from __future__ import annotations

import pytest

from stp.schedule.registry import generate
from stp.sim import Costs, simulate
from stp.sim.inlayer import InLayer, chunk_timeline


def _one_rank(costs: Costs, plan: InLayer | None, braid: bool = True):
    """zb-h1 at p=1, m=1: F, B, W of one microbatch on one rank; two layers, so
    four units a pass."""
    return simulate(generate("zb-h1", 1, 1), costs, layers=2, braid=braid, in_layer=plan)


def test_two_layer_chunked_timeline_equals_hand_count():
    """Two layers, f=b=4, w=2, ag=rs=2 per pass: four units, each g_F = g_B = 1,
    g_W = 0.5, a = r = 0.5. K = 2, one more collective call L = 0.1, matmul
    efficiency at s/2 rows e = 0.8:

        a' = r' = 0.5/2 + 0.1 * 1/2 = 0.3,  g' = 1 / 2 / 0.8 = 0.625
        F unit: g' >= a' + r', compute bound: T = a' + 2 g' + r' = 1.85
                (AG1 0-0.3, G1 0.3-0.925, AG2 0.3-0.6, RS1 0.925-1.225,
                 G2 0.925-1.55, RS2 1.55-1.85)
        F pass: 4 x 1.85 = 7.4; B pass the same: 7.4
        W unit: gathers its input again, a' = 0.3, g' = 0.5 / 2 / 0.8 = 0.3125:
                T = max(a' + 2 g', 2 a' + g') = max(0.925, 0.9125) = 0.925
        W pass: 4 x 0.925 = 3.7;  step: 7.4 + 7.4 + 3.7 = 18.5
        compute: 4 x (1.25 + 1.25 + 0.625) = 12.5; exposed TP: 18.5 - 12.5 = 6.0
        TP pieces: F and B units 4 x 2 x 1.2, W units 4 x 0.6: 12.0
    """
    res = _one_rank(Costs(f=4, b=4, w=2, ag=2, rs=2), InLayer(2, launch=0.1, efficiency=0.8))
    assert res.makespan == pytest.approx(18.5)
    rank = res.ranks[0]
    assert rank.compute == pytest.approx(12.5)
    assert rank.exposed_tp == pytest.approx(6.0)
    assert rank.tp_total == pytest.approx(12.0)
    assert res.mode == "both"
    pieces = [(s.kind, round(s.start, 6), round(s.end, 6)) for s in res.spans
              if s.name == "0F0" and s.unit == 0]
    assert sorted(pieces) == [
        ("AG", 0.0, 0.3), ("AG", 0.3, 0.6), ("F", 0.3, 0.925), ("F", 0.925, 1.55),
        ("RS", 0.925, 1.225), ("RS", 1.55, 1.85)]


def test_collective_bound_unit_keeps_the_tp_lane_busy():
    """ag = rs = 8 per pass: a = r = 2 a unit, g = 1, K = 2, no launch cost:
    a' = r' = 1, g' = 0.5 <= a'. AG1 0-1, G1 1-1.5, AG2 1-2, RS1 2-3 (queued
    behind AG2), G2 2-2.5, RS2 3-4: T = K (a' + r') + max(0, g' - r') = 4."""
    line = chunk_timeline(0.0, 0.0, 1.0, 2.0, 2.0, InLayer(2), record=True)
    assert line.end == pytest.approx(4.0)
    assert line.pieces == (("AG", 0.0, 1.0), ("AG", 1.0, 2.0), ("G", 1.0, 1.5),
                           ("RS", 2.0, 3.0), ("G", 2.0, 2.5), ("RS", 3.0, 4.0))
    res = _one_rank(Costs(f=4, b=4, w=2, ag=8, rs=8), InLayer(2))
    # F, B: 4 units x 4; W: a' = 1, g' = 0.25: max(1 + 0.5, 2 + 0.25) = 2.25 a unit
    assert res.makespan == pytest.approx(16 + 16 + 4 * 2.25)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_closed_forms(k):
    """The module's two closed forms, where they apply."""
    lat, eff = 0.01, 0.9
    ap = 0.2 / k + lat * (k - 1) / k
    gp = 3.0 / k / eff
    line = chunk_timeline(0.0, 0.0, 3.0, 0.2, 0.2, InLayer(k, lat, eff))
    assert line.end == pytest.approx(ap + k * gp + ap)  # compute bound
    line = chunk_timeline(0.0, 0.0, 0.01, 1.0, 1.0, InLayer(k, lat, eff))
    ap = 1.0 / k + lat * (k - 1) / k
    gp = 0.01 / k / eff
    assert line.end == pytest.approx(k * 2 * ap + max(0.0, gp - ap))  # collective bound
    w = chunk_timeline(0.0, 0.0, 3.0, 0.2, 0.0, InLayer(k, lat, eff))
    ap, gp = 0.2 / k + lat * (k - 1) / k, 3.0 / k / eff
    assert w.end == pytest.approx(max(ap + k * gp, k * ap + gp))


def test_no_collectives_no_chunking():
    """TP 1: nothing to overlap, so no chunk and no efficiency lost."""
    res = _one_rank(Costs(f=4, b=4, w=2), InLayer(4, launch=0.5, efficiency=0.5))
    assert res.makespan == pytest.approx(10.0)


def test_unbraided_runs_a_block_pass_by_pass():
    """braid=False: STP's blocks lose the braid, so with collectives it is no faster
    than braided and its TP bubble grows."""
    sch = generate("stp", 4, 8)
    tp = Costs(f=1, b=1, w=1, ar=0.3)
    braided, apart = simulate(sch, tp, layers=2), simulate(sch, tp, layers=2, braid=False)
    assert apart.mode == "none"
    assert apart.tp_bubble > braided.tp_bubble + 0.5
    assert apart.makespan > braided.makespan


def test_hybrid_keeps_braided_blocks_and_chunks_lone_passes():
    """STP's braided blocks keep the braid rule in the hybrid: chunking costs nothing
    there, so with free chunks the hybrid is never slower than braiding alone and
    strictly faster where lone passes expose collectives."""
    sch = generate("stp", 4, 8)
    c = Costs(f=1, b=1, w=1, ag=0.15, rs=0.15)
    braided = simulate(sch, c, layers=2)
    both = simulate(sch, c, layers=2, in_layer=InLayer(4))
    assert both.makespan < braided.makespan
    lone = [s for s in both.spans if s.lane == "tp" and not s.braided]
    braided_tp = [s for s in both.spans if s.lane == "tp" and s.braided]
    assert lone and braided_tp
    assert {s.kind for s in braided_tp} <= {"AG", "RS", "RS+AG"}


def test_bad_chunks_refused_in_one_line():
    for bad in (0, -1, 2.0, True, 65):
        with pytest.raises(ValueError, match="--tp-overlap-chunks"):
            InLayer(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="efficiency"):
        InLayer(2, efficiency=1.5)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "stp", "dualpipev", "1f1b-interleaved",
                                  "gpipe", "v-half"])
def test_one_chunk_without_gathers_is_the_plain_pass(name):
    """K = 1 cuts nothing: without sequence parallelism (all-reduces, all-to-alls,
    nothing gathered again in W) every pass times exactly as without overlap,
    braided blocks and passes alone alike."""
    sch = generate(name, 3, 9)
    c = Costs(f=1, b=1.2, w=0.8, ar=0.3, comm=0.1, a2a=0.1)
    plain = simulate(sch, c, layers=2)
    one = simulate(sch, c, layers=2, in_layer=InLayer(1))
    assert one.makespan == pytest.approx(plain.makespan, abs=1e-9)
    assert one.tp_bubble == pytest.approx(plain.tp_bubble, abs=1e-9)
    assert one.a2a_bubble == pytest.approx(plain.a2a_bubble, abs=1e-9)
