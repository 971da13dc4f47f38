"""The DP gradient reductions on the simulated timeline (stp.sim.dp_overlap) and
their price in the planner (stp.plan.price): each stage's reduction starts when
its last gradient pass ends, a rank's reductions run one after another, and
only what ends after the rank's compute (or, for the step, after the
pipeline) is exposed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stp.costmodel import HARDWARE
from stp.plan.price import dp_sync_parts
from stp.schedule import registry
from stp.sim import Costs, simulate
from stp.sim.dp_overlap import dp_timeline

HW = replace(HARDWARE["h100-80g"], pp_latency=0.0)
"""No latency: a reduction's time is its bytes over the bandwidth (sizes are exact)."""


def test_an_early_stage_hides_under_the_compute_after_its_last_w() -> None:
    # stage 3's last W ends at 10, stage 0's at 30 (the rank's end): 3's 5 units of
    # reduction run under 10..15, only stage 0's 4 are exposed
    line = dp_timeline({3: 10.0, 0: 30.0}, {3: 5.0, 0: 4.0}, 30.0)
    assert (line.end, line.total, line.exposed) == (34.0, 9.0, 4.0)
    off = dp_timeline({3: 10.0, 0: 30.0}, {3: 5.0, 0: 4.0}, 30.0, overlap=False)
    assert (off.end, off.exposed) == (39.0, 9.0)  # after the drain: all of it


def test_a_long_early_reduction_delays_the_last_one() -> None:
    # stage 3's reduction (10..35) still holds the link when stage 0 is final at 30
    line = dp_timeline({3: 10.0, 0: 30.0}, {3: 25.0, 0: 4.0}, 30.0)
    assert (line.end, line.exposed) == (39.0, 9.0)


def test_a_rank_that_ends_early_hides_its_whole_sync() -> None:
    """1F1B at pp2: rank 1 ends one F+B before rank 0 (its last B feeds rank 0's);
    a reduction shorter than that gap adds nothing to the step, a longer one only
    its excess; without the overlap all of it."""
    res = simulate(registry.make("1f1b", 2, 4), Costs(f=1, b=2, w=0, ar=0))
    gap = res.ranks[0].end - res.ranks[1].end
    assert gap > 0
    # parameters on rank 1 only, sized so that its all-reduce takes gap / 2 or 2 gap ms
    per_ms = 1.0 / (1e3 * _seconds_per_parameter(dp=8))
    for factor, hidden in ((0.5, True), (2.0, False)):
        params = [0.0, factor * gap * per_ms]
        added, total = dp_sync_parts(res, params, [1.0, 1.0], 8, HW, sharded=False, width=2)
        assert total == pytest.approx(factor * gap / 1e3, rel=1e-9)
        assert added == (0.0 if hidden else pytest.approx((factor - 1) * gap / 1e3, rel=1e-6))
        off, _ = dp_sync_parts(res, params, [1.0, 1.0], 8, HW, sharded=False, width=2,
                               overlap=False)
        assert off == pytest.approx(max(0.0, factor * gap - gap) / 1e3, rel=1e-6)


def test_the_sharded_optimizer_adds_its_all_gather_exposed() -> None:
    res = simulate(registry.make("zb-v", 2, 4), Costs(f=1, b=1, w=1, ar=0))
    params = [1e9, 1e9]
    plain, _ = dp_sync_parts(res, params, [1.0] * 4, 8, HW, sharded=False, width=2)
    sharded, total = dp_sync_parts(res, params, [1.0] * 4, 8, HW, sharded=True, width=2)
    gather = (7 * HW.pp_latency + 7 / 8 * 2 * 1e9 / HW.pp_bandwidth)
    assert sharded > gather  # the all-gather, plus the last stage's reduce-scatter
    assert total > sharded and plain > 0


def _seconds_per_parameter(dp: int) -> float:
    """A ring all-reduce's seconds per fp32 parameter on HW."""
    return 2 * (dp - 1) / dp * 4.0 / HW.pp_bandwidth
