import pytest

from stp.sim.costs import Costs, MemCosts, parse_costs, parse_mem


def test_parse_costs_overrides_defaults():
    c = parse_costs("f=2, b=3,ar=0.5")
    assert (c.f, c.b, c.w, c.ar, c.comm) == (2, 3, 1, 0.5, 0)


@pytest.mark.parametrize(
    "text, match",
    [
        ("f=-1", "f=-1.0 must be"),
        ("x=1", "unknown cost key 'x'"),
        ("f", "not KEY=VALUE"),
        ("f=abc", "'abc' is not a number"),
        ("f=nan", "must be a finite number"),
        ("f=0,b=0,w=0", "all zero"),
    ],
)
def test_bad_costs_name_the_value(text, match):
    with pytest.raises(ValueError, match=match):
        parse_costs(text)


def test_mem():
    assert parse_mem("b=2,w=0.5") == MemCosts(2.0, 0.5)
    with pytest.raises(ValueError, match="between 0 and b"):
        parse_mem("b=1,w=2")


def test_costs_reject_negative_direct():
    with pytest.raises(ValueError, match="comm"):
        Costs(comm=-0.1)
