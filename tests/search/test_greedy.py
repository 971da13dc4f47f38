"""The greedy list scheduler: valid, within the memory limit, and its internal
timeline equal to the simulator's when it claims to be exact."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stp.schedule import Block, generate, peak_by_order, validate
from stp.search import Policy, build, policies, warmup_caps
from stp.search.space import placement
from stp.sim import Costs, MemCosts, simulate

cost = st.floats(min_value=0.1, max_value=4.0, allow_nan=False)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["looped", "v"]))
    p = draw(st.integers(1, 6))
    chunks = draw(st.integers(1, 3)) if kind == "looped" else 2
    m = draw(st.integers(1, 3 * p + 2))
    ar = draw(st.sampled_from([0.0, 0.0, 0.5]))
    costs = Costs(f=draw(cost), b=draw(cost), w=draw(cost), ar=ar,
                  comm=draw(st.floats(0, 0.5)))
    mem = MemCosts(1.0, draw(st.sampled_from([0.0, 0.3, 1.0])))
    limit = draw(st.floats(1.0, 2.5 * p + 1))
    pol = draw(st.sampled_from(policies(chunks=chunks, braid=ar > 0)))
    if draw(st.booleans()):
        pol = replace(pol, cap=warmup_caps(placement(kind, p, chunks), costs))
    return placement(kind, p, chunks), m, costs, mem, limit, pol


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_greedy_schedule_validates_within_the_limit(case):
    pl, m, costs, mem, limit, pol = case
    built = build(pl, m, costs, mem, limit, pol)
    assert built is not None
    sch = built.schedule
    validate(sch, memory_limit=limit, mem=mem)
    assert max(peak_by_order(sch, mem)) <= limit + 1e-9
    if built.exact:
        res = simulate(sch, costs, mem, record_spans=False)
        assert built.makespan == pytest.approx(res.makespan, rel=1e-9, abs=1e-9)
        assert built.max_span == pytest.approx(res.critical_rank.span, rel=1e-9, abs=1e-9)


def test_limit_of_one_microbatch_runs_them_one_at_a_time():
    # At limit M_B a rank can hold one microbatch: no rank ever has two in flight.
    costs, mem = Costs(1, 1, 1), MemCosts(1.0, 0.4)
    for kind in ("looped", "v"):
        built = build(placement(kind, 4), 6, costs, mem, 1.0, Policy())
        assert built is not None
        assert max(peak_by_order(built.schedule, mem)) == pytest.approx(1.0)


def test_below_one_microbatch_builds_nothing():
    assert build(placement("looped", 4), 6, Costs(), MemCosts(), 0.9, Policy()) is None


def test_unit_costs_reproduce_zb_h2_and_zb_v():
    # T_F = T_B = T_W: the greedy with warm-up caps finds the zero-bubble
    # schedules of the paper (ZB-H2 at 2p-1 in one chunk, ZB-V at p in a V).
    p, m = 4, 12
    costs = Costs(1, 1, 1)
    pl = placement("looped", p)
    got = build(pl, m, costs, MemCosts(), 2 * p - 1, Policy(cap=warmup_caps(pl, costs)))
    ref = simulate(generate("zb-h2", p, m), costs)
    assert got.max_span == pytest.approx(ref.critical_rank.span) == 3 * m
    costs_v = Costs(2, 2, 2)
    got_v = build(placement("v", p), m, costs_v, MemCosts(), p, Policy(eager_w=True))
    ref_v = simulate(generate("zb-v", p, m), costs_v)
    assert got_v.makespan == pytest.approx(ref_v.makespan)
    assert got_v.max_span == pytest.approx(3 * 2 * m)


def test_warmup_caps_match_zb_h2_warmup():
    # One chunk, unit costs, no comm: 2(p-s)-1 forwards before the first B.
    assert warmup_caps(placement("looped", 5), Costs(1, 1, 1)) == (9, 7, 5, 3, 1)


def test_braided_policy_forms_blocks():
    costs = Costs(2, 2, 2, ar=1.0)
    pol = Policy(braid=True)
    built = build(placement("v", 4), 12, costs, MemCosts(), 8, pol)
    sch = built.schedule
    validate(sch, memory_limit=8)
    assert any(isinstance(a, Block) for acts in sch.actions for a in acts)
    assert not built.exact
