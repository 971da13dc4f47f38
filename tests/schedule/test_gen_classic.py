"""GPipe, 1F1B and interleaved 1F1B generators: validity, golden orders,
memory, bad input, and bubbles in the simulator."""

import re
import types

import pytest

from stp import sim
from stp.schedule import generate, peak_by_order, validate
from stp.schedule.gen_classic import (
    gpipe,
    interleaved_1f1b,
    interleaved_group_sizes,
    one_f_one_b,
)
from stp.schedule.ir import looped_placement

PS = range(1, 9)


def microbatch_counts(p: int) -> list[int]:
    """m < p, m = p, m = 1, m not a multiple of p, large m."""
    return sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p, 3 * p + 1, 4 * p, 32})


GRID = [(p, m) for p in PS for m in microbatch_counts(p)]


@pytest.mark.parametrize("p,m", GRID)
def test_all_valid(p, m):
    for sch, name, v in [
        (gpipe(p, m), "gpipe", 1),
        (one_f_one_b(p, m), "1f1b", 1),
        (interleaved_1f1b(p, m), "1f1b-interleaved", 2),
        (interleaved_1f1b(p, m, chunks=3), "1f1b-interleaved", 3),
    ]:
        validate(sch)
        assert sch.name == name
        assert sch.chunks == v == sch.meta["chunks"]
        assert sch.num_ranks == p and sch.num_microbatches == m


def test_registry_names_and_minimum():
    for name in ["gpipe", "1f1b", "1f1b-interleaved"]:
        sch = generate(name, 4, 1)  # every m >= 1 is accepted
        assert sch.name == name
        validate(sch)
    assert generate("1f1b-interleaved", 4, 6, chunks=3).chunks == 3


def test_placements():
    assert gpipe(4, 2).stage_to_rank == (0, 1, 2, 3)
    assert one_f_one_b(4, 2).stage_to_rank == (0, 1, 2, 3)
    assert interleaved_1f1b(3, 3, chunks=2).stage_to_rank == looped_placement(3, 2)
    assert interleaved_1f1b(3, 3, chunks=2).stage_to_rank == (0, 1, 2, 0, 1, 2)


def cells(text: str) -> list[str]:
    """Action strings of one rank, written space-separated."""
    return text.split()


# -- golden orders, written out by hand from the rules ------------------------


def test_gpipe_golden():
    assert gpipe(2, 3).rows() == [
        ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"],
        ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"],
    ]


def test_1f1b_golden_p4_m8():
    rows = one_f_one_b(4, 8).rows()
    # rank 0: 3 warm-up F, 5 (F, BW) pairs, 3 BW to drain
    assert rows[0] == cells("0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7")
    # rank 2: 1 warm-up F
    assert rows[2] == cells("2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7")
    # last rank: no warm-up, strict alternation
    assert rows[3] == cells("3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7")


def test_1f1b_few_microbatches():
    # m < p: the warm-up is capped at m, so rank 0 is GPipe
    assert one_f_one_b(4, 2).rows()[0] == cells("0F0 0F1 0B0 0B1")
    assert one_f_one_b(4, 2).meta["warmup"] == (2, 2, 1, 0)


def test_interleaved_golden_p2_m4():
    # groups (2, 2); table (mb, chunk): (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)
    # rank 0 holds stages 0, 2; warm-up 2*(2-0-1) + (2-1)*2 = 4
    # rank 1 holds stages 1, 3; warm-up 0 + 2 = 2
    sch = interleaved_1f1b(2, 4)
    assert sch.meta["groups"] == (2, 2)
    assert sch.meta["warmup"] == (4, 2)
    assert sch.rows() == [
        cells("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
        cells("1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"),
    ]


def test_interleaved_golden_uneven_groups():
    # p=2, m=5: rounds = 2, groups (3, 2), larger first; warm-up 2 + 3 = 5 on rank 0
    sch = interleaved_1f1b(2, 5)
    assert sch.meta["groups"] == (3, 2)
    assert sch.rows()[0] == cells(
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4"
    )


@pytest.mark.parametrize(
    "p,m,groups",
    [
        (4, 8, (4, 4)),
        (4, 4, (4,)),
        (4, 3, (3,)),
        (4, 10, (5, 5)),
        (4, 9, (5, 4)),
        (8, 17, (9, 8)),
        (3, 11, (4, 4, 3)),
        (1, 3, (1, 1, 1)),
    ],
)
def test_group_sizes(p, m, groups):
    assert interleaved_group_sizes(p, m) == groups
    assert sum(groups) == m


def _torch_interleaved_rows(p, m, v):
    """PyTorch's ScheduleInterleaved1F1B compute order, or None where PyTorch
    refuses m (it needs m % max(1, m // p) == 0)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = schedules.ScheduleInterleaved1F1B
    calc = getattr(cls, "_calculate_single_rank_operations", None)
    if calc is None:
        pytest.skip("PyTorch's private order helper is gone")
    rounds = max(1, m // p)
    if m % rounds:
        return None
    # The helper reads only these attributes; no process group is needed.
    fake = types.SimpleNamespace(
        n_local_stages=v, pp_group_size=p, _n_microbatches=m, microbatches_per_round=m // rounds
    )
    return [[str(a) for a in calc(fake, r) if a is not None] for r in range(p)]


def test_interleaved_matches_pytorch():
    checked = 0
    for v in (2, 3):
        for p in (1, 2, 3, 4, 5):
            for m in range(1, 3 * p + 2):
                theirs = _torch_interleaved_rows(p, m, v)
                if theirs is None:
                    continue
                assert interleaved_1f1b(p, m, chunks=v).rows() == theirs, (p, m, v)
                checked += 1
    assert checked > 50


# -- memory ---------------------------------------------------------------------


@pytest.mark.parametrize("p,m", GRID)
def test_peak_memory(p, m):
    assert peak_by_order(gpipe(p, m)) == [m] * p
    assert peak_by_order(one_f_one_b(p, m)) == [min(p - r, m) for r in range(p)]
    for v in (2, 3):
        sch = interleaved_1f1b(p, m, chunks=v)
        g0 = interleaved_group_sizes(p, m)[0]
        for r, peak in enumerate(peak_by_order(sch)):
            # warm-up forwards, plus the first steady forward before its paired BW frees
            warmup = min(2 * (p - r - 1) + (v - 1) * g0, m * v)
            assert peak == pytest.approx(min(warmup + 1, m * v) / v)


@pytest.mark.parametrize("p,k,v", [(2, 1, 2), (4, 2, 2), (4, 3, 3), (8, 2, 2), (8, 4, 4)])
def test_interleaved_peak_rank0_when_p_divides_m(p, k, v):
    m = k * p
    assert peak_by_order(interleaved_1f1b(p, m, chunks=v))[0] == pytest.approx(
        min((v + 1) * p - 1, m * v) / v
    )


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 0, -2, 2.0, "2", True])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match=re.escape(f"chunks={chunks!r}") + ".*>= 2"):
        interleaved_1f1b(4, 8, chunks=chunks)


@pytest.mark.parametrize("gen", [gpipe, one_f_one_b, interleaved_1f1b])
def test_bad_sizes(gen):
    with pytest.raises(ValueError, match="pipeline size 0"):
        gen(0, 4)
    with pytest.raises(ValueError, match="-1 microbatches"):
        gen(4, -1)
    with pytest.raises(ValueError, match="'3' microbatches"):
        gen(4, "3")


# -- bubbles in the simulator -----------------------------------------------------

COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0)]


def bubble(sch, f, b, w):
    """span - compute on the critical rank, uniform costs, no communication."""
    res = sim.simulate(sch, sim.Costs(f=f, b=b, w=w, ar=0.0, comm=0.0))
    crit = res.critical_rank
    return crit.span - crit.compute


@pytest.mark.parametrize("p,m", [(p, m) for p in PS for m in (p, 2 * p + 1, 4 * p)])
@pytest.mark.parametrize("f,b,w", COSTS)
def test_bubble_gpipe_1f1b(p, m, f, b, w):
    assert bubble(gpipe(p, m), f, b, w) == pytest.approx((p - 1) * (f + b + w))
    assert bubble(one_f_one_b(p, m), f, b, w) == pytest.approx((p - 1) * (f + b + w))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_bubble_interleaved_megatron(p, k, v):
    """m a multiple of p: Megatron's (p-1)(T_F+T_B+T_W)/v."""
    for f, b, w in COSTS:
        sch = interleaved_1f1b(p, k * p, chunks=v)
        assert bubble(sch, f, b, w) == pytest.approx((p - 1) * (f + b + w) / v, abs=1e-9)


@pytest.mark.parametrize("p", [3, 4, 5, 8])
def test_bubble_interleaved_other_m(p):
    """Our grouping keeps the formula for every m >= p, not only multiples."""
    for m in (p + 1, 2 * p - 1, 2 * p + 1, 3 * p + 2):
        for v in (2, 3):
            sch = interleaved_1f1b(p, m, chunks=v)
            assert bubble(sch, 1.0, 1.0, 1.0) == pytest.approx((p - 1) * 3 / v, abs=1e-9)
