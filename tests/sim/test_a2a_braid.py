"""Expert parallelism's all-to-all in the simulator (`--cost a2a=`): each F/B unit
ends with one after its TP collective, hidden by the braid rule exactly as the
all-reduce is, exposed by a pass on its own (`stp.sim.engine`)."""

import pytest

from stp.schedule import generate
from stp.sim import Costs, MemCosts, parse_costs, simulate
from stp.sim.stages import StageCost, StageCosts

SCHEDULES = ["1f1b", "zb-h1", "1f1b-interleaved", "zb-v", "v-half", "stp", "dualpipev"]


def _run(name: str, p: int, m: int, **costs: float):
    return simulate(generate(name, p, m), Costs(f=2, b=2, w=2, **costs), layers=2)


def test_a_lone_pass_exposes_every_all_to_all():
    """ZB-H1 at p=1, m=1 runs F, B and W alone: F and B each wait for all of
    theirs (two units a layer, one all-to-all each)."""
    res = _run("zb-h1", 1, 1, a2a=0.6)
    assert res.makespan == pytest.approx(6 + 2 * 0.6)
    assert res.ranks[0].exposed_a2a == pytest.approx(2 * 0.6)
    assert res.ranks[0].exposed_tp == 0
    assert res.ranks[0].a2a_total == pytest.approx(2 * 0.6)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 12)])
def test_stp_braids_the_all_to_all_away_and_1f1b_does_not(p: int, m: int):
    """The TP-bubble column of the STP paper's table, for the all-to-all: a
    forward on its own exposes its all-to-alls, so 1F1B exposes every F's (m of
    them; B's run under its own W), ZB-V every F's and B's (4m per chunk), STP
    only its warm-up forwards' (2p + 1 chunk passes)."""
    a2a = 0.8
    stp = _run("stp", p, m, a2a=a2a)
    assert stp.a2a_bubble == pytest.approx((2 * p + 1) * a2a / 2)
    one = _run("1f1b", p, m, a2a=a2a)
    assert one.a2a_bubble == pytest.approx(m * a2a)
    zbv = _run("zb-v", p, m, a2a=a2a)
    assert zbv.a2a_bubble == pytest.approx(4 * m * a2a / 2)
    for res in (stp, one, zbv):
        for r in res.ranks:
            assert r.a2a_total == pytest.approx(2 * m * a2a)
            assert r.hidden_a2a == pytest.approx(r.a2a_total - r.exposed_a2a)
    assert stp.a2a_bubble < one.a2a_bubble < zbv.a2a_bubble


@pytest.mark.parametrize("name", SCHEDULES)
def test_an_all_to_all_is_charged_like_an_all_reduce(name: str):
    """Same lane, same place, same braid rule: a2a=x alone times every schedule
    as ar=x alone, and with both, the exposed time splits between them."""
    for p, m in ((2, 6), (4, 8)):
        as_ar = _run(name, p, m, ar=0.9)
        as_a2a = _run(name, p, m, a2a=0.9)
        both = _run(name, p, m, ar=0.4, a2a=0.5)
        assert as_a2a.makespan == pytest.approx(as_ar.makespan)
        assert both.makespan == pytest.approx(as_ar.makespan)
        for a, b, c in zip(as_ar.ranks, as_a2a.ranks, both.ranks, strict=True):
            assert b.exposed_a2a == pytest.approx(a.exposed_tp)
            assert c.exposed_a2a + c.exposed_tp == pytest.approx(a.exposed_tp)
            assert b.idle == pytest.approx(a.idle)


def test_all_to_all_spans_follow_their_unit_collective():
    """Each F/B unit's TP lane holds its all-reduce, then its all-to-all (the
    router between them is folded into the unit); `stp draw` colours them apart."""
    res = _run("stp", 2, 4, ar=0.4, a2a=0.4)
    tp = [s for s in res.spans if s.lane == "tp"]
    ar = {(s.rank, s.name, s.unit): s for s in tp if s.kind == "AR"}
    a2a = [s for s in tp if s.kind == "A2A"]
    assert a2a and len(a2a) == len(ar)
    for s in a2a:
        assert ar[(s.rank, s.name, s.unit)].end == pytest.approx(s.start)


def test_parse_and_stage_tables_carry_it():
    assert parse_costs("f=2,a2a=0.25").a2a == 0.25
    assert parse_costs("a2a=0.5").tp_time == 0.5  # the search braids when it is > 0
    for bad, said in (("a2a=-1", "a2a=-1.0 must be a finite number >= 0"),
                      ("a2a=nan", "must be a finite number"),
                      ("a2a=lots", "cost a2a='lots' is not a number"),
                      ("a2b=1", "unknown cost key 'a2b'")):
        with pytest.raises(ValueError, match=said):
            parse_costs(bad)
    table = StageCosts.uniform(Costs(a2a=0.6), MemCosts(), 4, 2)
    assert table.stages[0].a2a == pytest.approx(0.3)
    back = StageCosts.from_json(table.to_json())
    assert back.stages[0].a2a == pytest.approx(0.3)
    assert back.mean_costs(2).a2a == pytest.approx(0.6)
    with pytest.raises(ValueError, match="a2a"):
        StageCost.from_json({"f": 1, "b": 1, "w": 1, "a2a": -2}, "stage 0")

