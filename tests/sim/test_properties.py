"""Property tests: every generator validates and simulates; makespan lower bounds."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stp.schedule import generate, validate
from stp.schedule.registry import SCHEDULES
from stp.sim import Costs, simulate

cost = st.floats(min_value=0.05, max_value=5.0, allow_nan=False)


@st.composite
def cases(draw):
    name = draw(st.sampled_from(list(SCHEDULES)))
    p = draw(st.integers(1, 16))
    lo = 1
    m = draw(st.integers(lo, lo + 2 * p + 4))
    costs = Costs(f=draw(cost), b=draw(cost), w=draw(cost),
                  ar=draw(st.floats(0, 1.0)), comm=draw(st.floats(0, 1.0)))
    layers = draw(st.integers(1, 2))
    return name, p, m, costs, layers


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_generated_schedules_validate_and_respect_lower_bounds(case):
    name, p, m, costs, layers = case
    sch = generate(name, p, m)
    validate(sch)
    res = simulate(sch, costs, layers=layers, record_spans=False)
    work = m * (costs.f + costs.b + costs.w)
    eps = 1e-9 * max(1.0, res.makespan)
    # bound 1: one rank's total compute
    for r in res.ranks:
        assert abs(r.compute - work) <= 1e-9 * max(1.0, work)
        assert r.span + eps >= work
    assert res.makespan + eps >= work
    # bound 2: one microbatch's critical path: down all stages and back, with sends
    v = sch.chunks
    crossings = sum(
        sch.stage_to_rank[s] != sch.stage_to_rank[s + 1] for s in range(sch.num_stages - 1)
    )
    path = sch.num_stages * (costs.f + costs.b) / v + 2 * crossings * costs.comm
    assert res.makespan + eps >= path
    # bookkeeping identities
    c = res.critical_rank
    assert abs(c.span - c.compute - c.exposed_tp - c.idle) <= eps
    assert res.tp_bubble >= -eps and res.pp_bubble >= -eps
