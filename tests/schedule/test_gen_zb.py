"""ZB-H1 / ZB-H2 generators: validity for every m, golden orders, memory,
bad input, and the Zero Bubble paper's bubbles in the simulator."""

import pytest

from stp import sim
from stp.schedule import MemCosts, generate, peak_by_order, validate
from stp.schedule.gen_zb import zb_h1, zb_h2
from stp.schedule.ir import Kind

PS = range(1, 9)


def microbatch_counts(p: int) -> list[int]:
    return sorted({1, 2, 3, max(1, p - 1), p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1, 32})


GRID = [(p, m) for p in PS for m in microbatch_counts(p)]


@pytest.mark.parametrize("p,m", GRID)
def test_all_valid(p, m):
    for sch, name in [(zb_h1(p, m), "zb-h1"), (zb_h2(p, m), "zb-h2")]:
        validate(sch)
        assert sch.name == name
        assert sch.split_backward
        assert sch.stage_to_rank == tuple(range(p))
        for r in range(p):
            kinds = [a.kind for a in sch.passes(r)]
            assert kinds.count(Kind.BW) == 0
            assert kinds.count(Kind.B) == kinds.count(Kind.W) == m


def test_every_small_case_valid():
    """ZB-H2 must stay correct for small m; check all m up to 2p+1."""
    for p in PS:
        for m in range(1, 2 * p + 2):
            validate(zb_h1(p, m))
            validate(zb_h2(p, m))


def test_registry():
    for name in ["zb-h1", "zb-h2"]:
        sch = generate(name, 3, 1)
        assert sch.name == name
        validate(sch)


def cells(text: str) -> list[str]:
    """Action strings of one rank, written space-separated."""
    return text.split()


# -- golden orders, written out by hand from the rules ------------------------


def test_zb_h1_golden_p4_m8():
    rows = zb_h1(4, 8).rows()
    # rank 0: 4 warm-up F; keeps no W pending: B, W, F
    assert rows[0] == cells(
        "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 "
        "0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7"
    )
    # rank 3: 1 warm-up F; keeps 3 W pending, the first W after the fourth B
    assert rows[3] == cells(
        "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 "
        "3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7"
    )


def test_zb_h2_golden_p3_m6():
    # warm-up 5, 3, 1 F; W delayed by 0, 2, 4
    assert zb_h2(3, 6).rows() == [
        cells("0F0 0F1 0F2 0F3 0F4 0I0 0W0 0F5 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5"),
        cells("1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1F5 1I3 1W1 1I4 1W2 1I5 1W3 1W4 1W5"),
        cells("2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2F5 2I5 2W1 2W2 2W3 2W4 2W5"),
    ]


def test_zb_h2_golden_small_m():
    # p=4, m=2: warm-up capped at 2 on ranks 0-2; delays 2s >= m push W to the end
    assert zb_h2(4, 2).rows() == [
        cells("0F0 0F1 0I0 0W0 0I1 0W1"),
        cells("1F0 1F1 1I0 1I1 1W0 1W1"),
        cells("2F0 2F1 2I0 2I1 2W0 2W1"),
        cells("3F0 3I0 3F1 3I1 3W0 3W1"),
    ]


def test_meta():
    assert zb_h1(4, 8).meta["warmup"] == (4, 3, 2, 1)
    assert zb_h2(4, 8).meta["warmup"] == (7, 5, 3, 1)
    assert zb_h2(4, 8).meta["pending_w"] == (0, 2, 4, 6)
    assert zb_h2(4, 8).meta["chunks"] == 1


# -- memory ---------------------------------------------------------------------


@pytest.mark.parametrize("p,m", GRID)
def test_peak_memory(p, m):
    assert peak_by_order(zb_h1(p, m)) == [min(p - s, m) for s in range(p)]
    assert peak_by_order(zb_h2(p, m)) == [min(2 * (p - s) - 1, m) for s in range(p)]
    assert max(peak_by_order(zb_h1(p, m))) == min(p, m)
    assert max(peak_by_order(zb_h2(p, m))) == min(2 * p - 1, m)


@pytest.mark.parametrize("p", PS)
def test_zb_h1_pending_w_memory(p):
    """With M_W > 0, rank s also holds the s W it delays: (p-s) M_B + s M_W."""
    mem = MemCosts(m_b=1.0, m_w=0.25)
    m = 2 * p
    peaks = peak_by_order(zb_h1(p, m), mem)
    assert peaks == pytest.approx([(p - s) + 0.25 * s for s in range(p)])


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("gen", [zb_h1, zb_h2])
def test_bad_sizes(gen):
    with pytest.raises(ValueError, match="pipeline size 0"):
        gen(0, 4)
    with pytest.raises(ValueError, match="0 microbatches"):
        gen(4, 0)
    with pytest.raises(ValueError, match="2.5 microbatches"):
        gen(4, 2.5)


# -- bubbles in the simulator -----------------------------------------------------

# T_F = T_B = T_W is the paper's assumption (section 2); the other sets keep
# T_W <= min(T_F, T_B), where the closed forms stay exact.
COSTS = [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5)]


def bubble(sch, f, b, w):
    res = sim.simulate(sch, sim.Costs(f=f, b=b, w=w, ar=0.0, comm=0.0))
    crit = res.critical_rank
    return crit.span - crit.compute


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("f,b,w", COSTS)
def test_bubble_zb_h1(p, f, b, w):
    for m in (p, p + 1, 3 * p):
        assert bubble(zb_h1(p, m), f, b, w) == pytest.approx((p - 1) * (f + b - w))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("f,b,w", COSTS)
def test_bubble_zb_h2(p, f, b, w):
    for m in (2 * p - 1, 2 * p, 4 * p):
        assert bubble(zb_h2(p, m), f, b, w) == pytest.approx((p - 1) * (f + b - 2 * w))


def test_zb_h2_zero_bubble_rate():
    res = sim.simulate(zb_h2(4, 12), sim.Costs(f=1, b=1, w=1))
    assert res.bubble_rate == pytest.approx(0.0)
    assert res.critical_rank.span == pytest.approx(12 * 3)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zb_h2_small_m_no_worse_than_h1(p):
    """The small-m claim of zb_h2's docstring: between the formula and ZB-H1,
    equal to ZB-H1 for m <= p."""
    for m in range(1, 2 * p):
        h1 = bubble(zb_h1(p, m), 1.0, 1.0, 1.0)
        h2 = bubble(zb_h2(p, m), 1.0, 1.0, 1.0)
        assert h2 <= h1 + 1e-9
        if m <= p:
            assert h2 == pytest.approx(h1)
