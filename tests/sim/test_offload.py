"""Activation offload in the simulator (STP offload variant, PipeOffload)."""

import pytest

from stp.schedule import generate, validate
from stp.schedule.offload import OffloadPlan, parse_policy, plan_chunks
from stp.sim import Costs, MemCosts, OffloadCosts, simulate
from stp.sim.offload import offload_ratio, plan_offload

COSTS = Costs(f=2, b=2, w=2, ar=0.4)


def run(name, p, m, policy, bw=1.0, mem=None):
    mem = mem or MemCosts()
    sch = generate(name, p, m)
    validate(sch)
    oc = OffloadCosts(bandwidth=bw)
    plan = plan_offload(sch, policy, COSTS, mem, oc)
    return sch, plan, simulate(sch, COSTS, mem, offload=plan, offload_costs=oc)


def test_none_changes_nothing():
    sch, plan, res = run("stp", 4, 16, "none")
    base = simulate(sch, COSTS)
    assert len(plan) == 0
    assert res.makespan == base.makespan and res.peak_activation == base.peak_activation


def test_stp_policy_meets_issue_target():
    """p=4, m=16, f=b=w=2, ar=0.4, default bandwidth: peak -10%, time +5% at most."""
    sch, plan, res = run("stp", 4, 16, "stp")
    base = simulate(sch, COSTS)
    assert {sch.chunk_of(s) for s, _ in plan.reload_at} == {0}
    assert max(res.peak_activation) <= 0.9 * max(base.peak_activation)
    assert res.makespan <= 1.05 * base.makespan


def test_slow_link_costs_time_and_is_reported_as_offload_wait():
    sch, _, slow = run("stp", 4, 16, "all", bw=0.05)
    base = simulate(sch, COSTS)
    assert slow.makespan > base.makespan
    assert sum(r.exposed_offload for r in slow.ranks) > 0
    for r in slow.ranks:
        assert r.span == pytest.approx(r.compute + r.exposed_tp + r.exposed_offload + r.idle)


def test_backward_starts_after_its_reload():
    _, plan, res = run("zb-v", 4, 8, "all", bw=0.2)
    reload_end = {(s.stage, s.mb): s.end for s in res.spans if s.lane == "h2d"}
    out_end = {(s.stage, s.mb): s.end for s in res.spans if s.lane == "d2h"}
    assert set(reload_end) == set(plan.reload_at) == set(out_end)
    for s in res.spans:
        if s.lane == "compute" and s.kind == "B" and (s.stage, s.mb) in reload_end:
            assert s.start >= reload_end[(s.stage, s.mb)] - 1e-12
    for key, t in reload_end.items():
        assert t >= out_end[key]


@pytest.mark.parametrize("frac", [0.2, 0.4])
def test_selective_cuts_about_the_asked_fraction(frac):
    sch, plan, res = run("stp", 4, 16, f"selective:{frac}")
    base = simulate(sch, COSTS)
    assert 0 < len(plan) < len(plan_chunks(sch, None).reload_at)
    assert max(res.peak_activation) <= (1 - frac) * max(base.peak_activation) + 1e-9


def test_selective_stops_at_the_best_reachable_peak():
    # 1F1B reloads one block ahead, so offload can cut rank 0 from 4 to 3 only
    sch, plan, res = run("1f1b", 4, 16, "selective:0.6")
    _, every, best = run("1f1b", 4, 16, "all")
    assert max(res.peak_activation) == max(best.peak_activation) == 3.0
    assert len(plan) < len(every)


def test_selective_skips_short_lived_activations():
    # on 1f1b the last rank's activations live one B long: never worth a round trip
    sch, plan, _ = run("1f1b", 4, 16, "selective:0.5", bw=0.5)
    assert not [k for k in plan.reload_at if sch.stage_to_rank[k[0]] == 3]


def test_memory_never_negative_and_peak_not_above_baseline():
    for name in ("stp", "zb-v", "1f1b-interleaved", "v-half"):
        sch, _, res = run(name, 4, 12, "all", mem=MemCosts(1.0, 0.3))
        base = simulate(sch, COSTS, MemCosts(1.0, 0.3))
        for curve in res.memory:
            assert min(v for _, v in curve) >= -1e-9
            assert curve[-1][1] == pytest.approx(0.0, abs=1e-9)
        assert max(res.peak_activation) <= max(base.peak_activation) + 1e-9


def test_plan_rows_show_copies():
    sch = generate("stp", 2, 6)
    plan = plan_chunks(sch, {0})
    rows = plan.rows(sch)
    flat = " ".join(rows[0])
    assert "0OFFLOAD" in flat and "0RELOAD" in flat
    assert OffloadPlan().rows(sch) == sch.rows()


def test_k_ratio():
    assert offload_ratio(Costs(f=1, b=1, w=1), MemCosts(), OffloadCosts(bandwidth=2)) == 1 / 6


@pytest.mark.parametrize("bad", ["some", "selective", "selective:1.5", "selective:x"])
def test_bad_policy(bad):
    with pytest.raises(ValueError, match="offload policy|unknown offload"):
        parse_policy(bad)


def test_bad_bandwidth():
    with pytest.raises(ValueError, match="bandwidth"):
        OffloadCosts(bandwidth=0)


def test_compare_shows_with_and_without_offload(capsys):
    import json

    from stp.cli.main import main

    assert main(["compare", "--pp", "4", "-m", "16", "--cost", "f=2,b=2,w=2,ar=0.4",
                 "--offload", "stp", "--schedules", "stp,zb-v", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for row in rows:
        assert max(row["peak_activation"]) < max(row["without_offload"]["peak_activation"])
        assert row["makespan"] >= row["without_offload"]["makespan"] - 1e-9
