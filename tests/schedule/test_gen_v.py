"""Tests of the V-shape generators ZB-V, V-Half, V-Min ("Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, section 6; "Pipeline Parallelism with
Controllable Memory", arXiv 2405.15362, section 4)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stp.schedule import Kind, MemCosts, Pass, generate, peak_by_order, validate
from stp.schedule.building_block import block_peak, repeat, squeeze, steady_window
from stp.schedule.gen_v import (
    controllable_memory_block,
    v_half,
    v_half_offsets,
    v_min,
    v_min_offsets,
    zb_v,
    zero_bubble_min_microbatches,
)
from stp.schedule.ir import Schedule, v_placement
from stp.schedule.validate import dependencies
from stp.sim import Costs, simulate

RANKS = range(1, 9)
GENERATORS = {"zb-v": zb_v, "v-half": v_half, "v-min": v_min}
OFFSETS = {"v-half": v_half_offsets, "v-min": v_min_offsets}
M_W_ONLY = MemCosts(m_b=1.0, m_w=1.0)  # every activation kept until its W


def half_peak(p: int) -> int:
    """V-Half's peak, controllable-memory paper: (p+2)//2 M_B."""
    return (p + 2) // 2


def min_peak(p: int) -> int:
    """V-Min's peak, controllable-memory paper: (p+4)//3 M_B (activations
    counted until W)."""
    return (p + 4) // 3


def min_peak_free_at_b(p: int) -> int:
    """V-Min's peak when B frees the activation (M_W = 0): one lower when p%3 == 2."""
    return (p + 1) // 3 if p % 3 == 2 else min_peak(p)


# ZB-V, p=4, m=8, rank 0 (stages 0 and 7), written out from the rule of
# `zb_v`'s docstring: warm-up 2p-1 = 7 chunk-0 forwards (r = 0: no pairs);
# p-r = 4 groups of chunk 1; then chunk 0 / chunk 1 alternate (0F7 is the
# last forward of chunk 0, so later chunk-0 groups have no F); cool-down:
# r = 0 pairs (B0, B1), p-r = 4 pairs (B0, W0), no W left.
_GOLDEN_LINES = (
    "0F0 0F1 0F2 0F3 0F4 0F5 0F6",                           # warm-up
    "7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3",       # 4 chunk-1 groups
    "0F7 0I0 0W0 7F4 7I4 7W4",                               # alternate
    "0I1 0W1 7F5 7I5 7W5",
    "0I2 0W2 7F6 7I6 7W6",
    "0I3 0W3 7F7 7I7 7W7",
    "0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",                       # cool-down
)
GOLDEN_ZBV_P4_M8_RANK0 = [cell for line in _GOLDEN_LINES for cell in line.split()]


def _check_shape(s: Schedule, p: int, m: int) -> None:
    assert (s.num_ranks, s.num_microbatches) == (p, m)
    assert s.stage_to_rank == v_placement(p)
    assert s.split_backward
    assert all(q.kind is not Kind.BW for r in range(p) for q in s.passes(r))
    validate(s)


# -- every output validates ----------------------------------------------------


@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize("p", RANKS)
def test_valid_for_every_small_m(name: str, p: int) -> None:
    for m in range(1, 3 * p + 3):
        _check_shape(GENERATORS[name](p, m), p, m)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 64), name=st.sampled_from(sorted(GENERATORS)))
def test_valid_and_within_peak_for_any_m(p: int, m: int, name: str) -> None:
    s = GENERATORS[name](p, m)
    _check_shape(s, p, m)
    bound = {"zb-v": p, "v-half": half_peak(p), "v-min": min_peak(p)}[name]
    for mem in (MemCosts(), MemCosts(m_b=1.0, m_w=0.3), M_W_ONLY):
        assert max(peak_by_order(s, mem)) <= min(bound, m) + 1e-9


def test_registry_accepts_every_m_and_refuses_bad_sizes() -> None:
    for name in GENERATORS:
        assert generate(name, 4, 1).num_microbatches == 1
        with pytest.raises(ValueError, match="pipeline size"):
            generate(name, 0, 4)
        with pytest.raises(ValueError, match="microbatches"):
            GENERATORS[name](4, 0)


# -- ZB-V ------------------------------------------------------------------------


def test_zb_v_golden_p4_m8_rank0() -> None:
    assert zb_v(4, 8).rows()[0] == GOLDEN_ZBV_P4_M8_RANK0


@pytest.mark.parametrize("p", RANKS)
def test_zb_v_peak_is_p_on_every_rank(p: int) -> None:
    for m in range(zero_bubble_min_microbatches(p), 4 * p + 1):
        peaks = peak_by_order(zb_v(p, m))
        # 2p chunk activations of 1/2 each, balanced: 1F1B's rank-0 peak on every rank.
        assert peaks == [p] * p, (m, peaks)


def test_zb_v_small_m_drops_missing_microbatches() -> None:
    p = 4
    full = zb_v(p, zero_bubble_min_microbatches(p))
    for m in range(1, zero_bubble_min_microbatches(p)):
        s = zb_v(p, m)
        assert s.meta["truncated_from"] == zero_bubble_min_microbatches(p)
        for r in range(p):
            assert list(s.passes(r)) == [q for q in full.passes(r) if q.mb < m]


def test_zb_v_matches_pytorch_order() -> None:
    """PyTorch's ScheduleZBVZeroBubble computes its per-rank order from three
    attributes; we call that step on a stand-in object (no process group)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, "ScheduleZBVZeroBubble", None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no ScheduleZBVZeroBubble order builder")
    for p in RANKS:
        for m in (1, p, 2 * p - 1, 2 * p, 3 * p + 1):
            fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            ours = zb_v(p, m).rows()
            for r in range(p):
                theirs = cls._calculate_single_rank_operations(fake, r)
                assert [str(a) for a in theirs if a is not None] == ours[r], (p, m, r)


# -- V-Half, V-Min: the building blocks ------------------------------------------


@pytest.mark.parametrize("name", OFFSETS)
def test_block_offsets_respect_dependencies_and_tile_the_period(name: str) -> None:
    for p in range(1, 25):
        block = controllable_memory_block(p, OFFSETS[name](p))
        slots = repeat(block, 1)
        for q, t in slots.items():
            for s, k, i in dependencies(q, 2 * p):
                dep = Pass(s, {"F": Kind.F, "B": Kind.B, "W": Kind.W}[k], i)
                assert slots[dep] < t, (p, q, dep)
        for offs in block.offsets:
            # Six passes per rank on six distinct residues: a dense steady state.
            assert sorted(t % 6 for t in offs.values()) == list(range(6))


@pytest.mark.parametrize("name", OFFSETS)
def test_block_peak_is_lifespan_over_period(name: str) -> None:
    """block_peak (the paper's lifespan / T, counted in closed form) equals the
    order-based peak of the plain repetition once it reaches steady state."""
    for p in RANKS:
        block = controllable_memory_block(p, OFFSETS[name](p))
        slots = repeat(block, 3 * p + 4)
        order = [sorted((q for q in slots if block.stage_to_rank[q.stage] == r),
                        key=slots.__getitem__) for r in range(p)]
        s = Schedule(name, p, 3 * p + 4, block.stage_to_rank, tuple(map(tuple, order)))
        validate(s)
        for upto, mem in ((Kind.B, MemCosts()), (Kind.W, M_W_ONLY)):
            assert peak_by_order(s, mem) == [block_peak(block, r, upto) / 2 for r in range(p)]


@pytest.mark.parametrize("name", OFFSETS)
def test_squeeze_only_moves_passes_earlier(name: str) -> None:
    for p in (3, 4, 8):
        block = controllable_memory_block(p, OFFSETS[name](p))
        m = 4 * p
        before, after = repeat(block, m), squeeze(block, m)
        lo, hi = steady_window(block, m)
        assert lo <= hi
        assert before.keys() == after.keys()
        assert all(after[q] <= before[q] for q in before)
        assert any(after[q] < before[q] for q in before)
        # The steady state keeps the block's slots, hence its order.
        assert all(after[q] == t for q, t in before.items() if lo <= t <= hi)


@pytest.mark.parametrize("p", RANKS)
def test_v_half_peak(p: int) -> None:
    for m in range(1, 4 * p + 1):
        s = v_half(p, m)
        want = min(half_peak(p), m)
        assert max(peak_by_order(s)) == want, m
        assert max(peak_by_order(s, M_W_ONLY)) == want, m


@pytest.mark.parametrize("p", RANKS)
def test_v_min_peak(p: int) -> None:
    for m in range(1, 4 * p + 1):
        s = v_min(p, m)
        assert max(peak_by_order(s, M_W_ONLY)) == min(min_peak(p), m), m
        assert max(peak_by_order(s)) == min(min_peak_free_at_b(p), m), m


# -- in the simulator (T_F = T_B = T_W, no TP all-reduce, no send latency) -------


@pytest.mark.parametrize("p", RANKS)
def test_zb_v_has_zero_bubble_in_simulator(p: int) -> None:
    """Zero Bubble (section 5) measures a rank's bubble over its own
    span, from its first F to its last pass; ZB-V's is zero on every rank once
    m >= 2p-1. What the measure leaves out is unavoidable: rank r's first
    input arrives r chunk forwards after rank 0's, so the makespan is the
    busy time plus (p-1) chunk forwards, (p-1) T_F / 2."""
    from stp.sim import Costs, simulate

    for t in (2.0, 3.0):
        costs = Costs(f=t, b=t, w=t)
        for m in (zero_bubble_min_microbatches(p), 2 * p, 3 * p + 1):
            res = simulate(zb_v(p, m), costs)
            busy = m * (costs.f + costs.b + costs.w)
            for rank in res.ranks:
                assert rank.compute == pytest.approx(busy)
                assert rank.span == pytest.approx(busy), (m, rank)
            assert res.bubble_rate == pytest.approx(0.0, abs=1e-12)
            assert res.makespan == pytest.approx(busy + (p - 1) * costs.f / 2)
            assert res.peak_activation == [p] * p


@pytest.mark.parametrize("p", range(2, 9))
def test_v_half_and_v_min_bubbles_below_1f1b(p: int) -> None:
    """Controllable-memory paper: V-Half's bubble about 1/2 of 1F1B's, V-Min's about 2/3, at
    T_F = T_B = T_W; the steady state is dense, so the bubble does not grow
    with m."""
    from stp.sim import Costs, simulate

    costs = Costs(f=2.0, b=2.0, w=2.0)

    def idle(name: str, m: int) -> float:
        return simulate(generate(name, p, m), costs).critical_rank.idle

    base = idle("1f1b", 4 * p)
    assert base > 0
    for name, ratio in (("v-half", 0.6), ("v-min", 0.7)):
        assert idle(name, 4 * p) <= ratio * base, name
        assert idle(name, 8 * p) == pytest.approx(idle(name, 4 * p)), name


@pytest.mark.parametrize("p", range(2, 9))
def test_v_half_steady_state_stays_dense_under_the_papers_condition(p: int) -> None:
    """Controllable-memory paper: V-Half can stay bubble-free in the steady state when
    T_W + 2T_B >= 2T_F and T_W + 2T_F >= 2T_B; then its bubble does not grow
    with m even though the order was laid out for equal passes."""
    from stp.sim import Costs, simulate

    # A send latency eats into the condition's margins: the second set (margin
    # 0.1 in W + 2B - 2F) grows with m once comm=0.1 is added, the first does not.
    for costs in (Costs(f=1.0, b=1.2, w=0.8, comm=0.1), Costs(f=1.2, b=1.0, w=0.5)):
        assert costs.w + 2 * costs.b >= 2 * costs.f and costs.w + 2 * costs.f >= 2 * costs.b
        idle = [simulate(v_half(p, m), costs).critical_rank.idle for m in (4 * p, 8 * p)]
        assert idle[1] == pytest.approx(idle[0]), costs


# -- the paper's bubble counts (T_F = T_B = T_W, one slot per chunk pass) ----------


def half_bubble(p: int) -> int:
    """V-Half: 6p - 1 - 3l slots with l = 2((p+2)//2) chunk activations."""
    return 1 if p == 2 else 6 * p - 1 - 3 * 2 * half_peak(p)


def min_bubble(p: int) -> int:
    """V-Min: 6p - 1 - 3l with l = 2((p+4)//3); 4 slots more when p % 3 == 2."""
    return 3 if p == 2 else 6 * p - 1 - 3 * 2 * min_peak(p) + (4 if p % 3 == 2 else 0)


@pytest.mark.parametrize("p", range(2, 17))
def test_v_half_and_v_min_bubble_counts(p: int) -> None:
    costs = Costs(f=2.0, b=2.0, w=2.0)  # one slot per chunk pass
    for name, bubble, peak in (("v-half", half_bubble, half_peak), ("v-min", min_bubble, min_peak)):
        for m in (2 * p, 3 * p):
            res = simulate(generate(name, p, m), costs, M_W_ONLY, record_spans=False)
            assert res.critical_rank.span - 6 * m == bubble(p), (name, m)
            assert res.makespan - 6 * m == bubble(p), (name, m)
            assert max(res.peak_activation) == peak(p), (name, m)


def test_bubble_counts_closed_forms() -> None:
    # The counts above, spelled out: half of 1F1B's 6(p-1) for V-Half, 2/3 for V-Min.
    for p in range(3, 17):
        assert half_bubble(p) == (3 * p - 7 if p % 2 == 0 else 3 * p - 4)
        assert min_bubble(p) == (4 * p - 7 if p % 3 == 0 else 4 * p - 5)


def test_v_half_p4_m8_is_as_short_as_the_papers_scheduler() -> None:
    res = simulate(v_half(4, 8), Costs(f=2.0, b=2.0, w=2.0), M_W_ONLY)
    assert res.makespan <= 53
    assert max(res.peak_activation) == 3
