"""Simulator rules on hand-built schedules (no generator involved)."""

import pytest

from stp.schedule.ir import Block, Kind, Pass, Schedule
from stp.schedule.validate import validate
from stp.sim import Costs, MemCosts, simulate
from stp.sim.units import braid

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def one_rank(*actions, m=1, stages=1):
    return Schedule("t", 1, m, tuple([0] * stages), (tuple(actions),))


def test_lone_forward_waits_for_every_all_reduce():
    sch = one_rank(Pass(0, F, 0), Pass(0, BW, 0))
    validate(sch)
    res = simulate(sch, Costs(f=1, b=1, w=1, ar=0.4), layers=2)
    r = res.ranks[0]
    # F exposes all its all-reduce; BW hides each B all-reduce under its W unit
    assert r.exposed_tp == pytest.approx(0.4)
    assert r.compute == pytest.approx(3.0)
    assert res.makespan == pytest.approx(3.4)


def test_split_backward_exposes_both_all_reduces():
    sch = one_rank(Pass(0, F, 0), Pass(0, B, 0), Pass(0, W, 0))
    res = simulate(sch, Costs(f=1, b=1, w=1, ar=0.4))
    assert res.ranks[0].exposed_tp == pytest.approx(0.8)


def test_full_backward_exposes_the_excess_of_all_reduce_over_w():
    sch = one_rank(Pass(0, F, 0), Pass(0, BW, 0))
    res = simulate(sch, Costs(f=1, b=1, w=0.2, ar=1.0), layers=1)
    # per unit: AR 0.5 against W 0.1 -> 0.4 exposed per B unit, plus F's 1.0
    assert res.ranks[0].exposed_tp == pytest.approx(1.0 + 2 * 0.4)


def test_braided_forward_with_full_backward_hides_everything():
    # mb0 forward alone, then F(mb1) braided with BW(mb0), then BW(mb1) alone
    sch = one_rank(
        Pass(0, F, 0), Block((Pass(0, F, 1), Pass(0, BW, 0))), Pass(0, BW, 1), m=2
    )
    validate(sch)
    res = simulate(sch, Costs(f=1, b=1, w=1, ar=0.4), layers=1)
    assert res.ranks[0].exposed_tp == pytest.approx(0.4)  # only the lone F
    assert res.makespan == pytest.approx(6.4)


def test_braid_order_matches_stp_figure():
    items = braid(Block((Pass(0, F, 1), Pass(1, BW, 0))), units=2)
    got = [(i.kind, i.unit, i.chain) for i in items]
    # Attn(F) | MLP B | MLP W | MLP(F) | Attn B | Attn W
    assert got == [("F", 0, 0), ("B", 1, 1), ("W", 1, 1), ("F", 1, 0), ("B", 0, 1), ("W", 0, 1)]


def test_send_latency_only_across_ranks():
    # two stages on two ranks, then a V-like local hand-off on one rank
    two = Schedule(
        "t", 2, 1, (0, 1),
        ((Pass(0, F, 0), Pass(0, BW, 0)), (Pass(1, F, 0), Pass(1, BW, 0))),
    )
    res = simulate(two, Costs(f=1, b=1, w=1, comm=0.5))
    assert res.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    local = one_rank(Pass(0, F, 0), Pass(1, F, 0), Pass(1, BW, 0), Pass(0, BW, 0), stages=2)
    res = simulate(local, Costs(f=1, b=1, w=1, comm=0.5))
    assert res.makespan == pytest.approx(3.0)


def test_memory_follows_f_b_w():
    sch = one_rank(Pass(0, F, 0), Pass(0, F, 1), Pass(0, B, 0), Pass(0, W, 0),
                   Pass(0, B, 1), Pass(0, W, 1), m=2)
    res = simulate(sch, Costs(), MemCosts(m_b=1.0, m_w=0.25))
    assert res.peak_activation == [2.0]
    levels = [v for _, v in res.memory[0]]
    assert levels == pytest.approx([1, 2, 1.25, 1.0, 0.25, 0.0])


def test_span_and_bubble_rate_definition():
    two = Schedule(
        "t", 2, 1, (0, 1),
        ((Pass(0, F, 0), Pass(0, BW, 0)), (Pass(1, F, 0), Pass(1, BW, 0))),
    )
    res = simulate(two, Costs(f=1, b=1, w=1))
    c = res.critical_rank
    assert c.rank == 0 and c.span == pytest.approx(6.0) and c.compute == pytest.approx(3.0)
    assert res.bubble_rate == pytest.approx(0.5)
    assert res.pp_bubble == pytest.approx(3.0) and res.tp_bubble == 0


def test_bad_layers_rejected():
    with pytest.raises(ValueError, match="layers=0"):
        simulate(one_rank(Pass(0, F, 0), Pass(0, BW, 0)), layers=0)
