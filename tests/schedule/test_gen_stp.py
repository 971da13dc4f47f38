"""Tests of the STP generator ("Synergistic Tensor and Pipeline Parallelism",
Qi, Peng et al., NeurIPS 2025, arXiv 2510.27257, the schedule's nine phases)."""

from __future__ import annotations

import pytest

from stp.schedule import Block, Kind, MemCosts, Pass, generate, peak_by_order, validate
from stp.schedule.gen_stp import full_phase_min_microbatches, stp
from stp.schedule.ir import passes_of, v_placement
from stp.schedule.memory import action_memory

RANKS = range(1, 9)

# p=4, m=12 written out by hand from the nine phases (rank r holds stages r
# and 7-r). Phase boundaries are marked; "I" is our B (input grad only) with
# its W deferred, "B" a full backward.
_O = "OVERLAP_F_B"
GOLDEN_P4_M12 = [
    # r=0: 1: six F0 | 2: (F0, F1) | 3: lone F0 | 4: 3 x [FB1 def, FW0]
    ["0F0", "0F1", "0F2", "0F3", "0F4", "0F5", "0F6", "7F0", "0F7",
     f"(7F1;7I0){_O}", f"(0F8;7W0){_O}", f"(7F2;7I1){_O}", f"(0F9;7W1){_O}",
     f"(7F3;7I2){_O}", f"(0F10;7W2){_O}",
     # 5: 3 blocks FB1 FB0 FB1, none deferred
     f"(7F4;7B3){_O}", f"(0F11;0B0){_O}", f"(7F5;7B4){_O}",
     # 6: 6 x [B0 full, FB1 def] -> deferred 7W5..7W10
     "0B1", f"(7F6;7I5){_O}", "0B2", f"(7F7;7I6){_O}", "0B3", f"(7F8;7I7){_O}",
     "0B4", f"(7F9;7I8){_O}", "0B5", f"(7F10;7I9){_O}", "0B6", f"(7F11;7I10){_O}",
     # 7: [B0, B1] | 8: B0 WW B0 WW B0 WW B0 | 9: none
     "0B7", "7B11",
     "0B8", "7W5", "7W6", "0B9", "7W7", "7W8", "0B10", "7W9", "7W10", "0B11"],
    # r=1: 1: four F0 | 2: 2 x (F0, F1) | 3: one FF0 | 4: 2 x [FB1 def, FW0]
    ["1F0", "1F1", "1F2", "1F3", "1F4", "6F0", "1F5", "6F1", f"(1F6;1F7){_O}",
     f"(6F2;6I0){_O}", f"(1F8;6W0){_O}", f"(6F3;6I1){_O}", f"(1F9;6W1){_O}",
     # 5: 5 blocks, the last one defers 6W4
     f"(6F4;6B2){_O}", f"(1F10;1B0){_O}", f"(6F5;6B3){_O}", f"(1F11;1B1){_O}",
     f"(6F6;6I4){_O}",
     # 6: 5 x [B0, FB1 def] -> deferred 6W4..6W9
     "1B2", f"(6F7;6I5){_O}", "1B3", f"(6F8;6I6){_O}", "1B4", f"(6F9;6I7){_O}",
     "1B5", f"(6F10;6I8){_O}", "1B6", f"(6F11;6I9){_O}",
     # 7: 2 x [B0, B1] | 8: B0 WW B0 WW B0 | 9: two W
     "1B7", "6B10", "1B8", "6B11",
     "1B9", "6W4", "6W5", "1B10", "6W6", "6W7", "1B11",
     "6W8", "6W9"],
    # r=2: 1: two F0 | 2: 3 x (F0, F1) | 3: lone F0 + one FF0 | 4: one pair
    ["2F0", "2F1", "2F2", "5F0", "2F3", "5F1", "2F4", "5F2", "2F5", f"(2F6;2F7){_O}",
     f"(5F3;5I0){_O}", f"(2F8;5W0){_O}",
     # 5: 7 blocks, the last two defer (2W2 of chunk 0, then 5W4)
     f"(5F4;5B1){_O}", f"(2F9;2B0){_O}", f"(5F5;5B2){_O}", f"(2F10;2B1){_O}",
     f"(5F6;5B3){_O}", f"(2F11;2I2){_O}", f"(5F7;5I4){_O}",
     # 6: 4 x [B0, FB1 def]
     "2B3", f"(5F8;5I5){_O}", "2B4", f"(5F9;5I6){_O}", "2B5", f"(5F10;5I7){_O}",
     "2B6", f"(5F11;5I8){_O}",
     # 7: 3 x [B0, B1] | 8: B0 WW B0 | 9: four W
     "2B7", "5B9", "2B8", "5B10", "2B9", "5B11",
     "2B10", "2W2", "5W4", "2B11",
     "5W5", "5W6", "5W7", "5W8"],
    # r=3: 1: none | 2: 4 x (F0, F1) | 3: two FF0 | 4: none
    ["3F0", "4F0", "3F1", "4F1", "3F2", "4F2", "3F3", "4F3",
     f"(3F4;3F5){_O}", f"(3F6;3F7){_O}",
     # 5: 9 blocks, the last three defer (4W3, 3W3, 4W4)
     f"(4F4;4B0){_O}", f"(3F8;3B0){_O}", f"(4F5;4B1){_O}", f"(3F9;3B1){_O}",
     f"(4F6;4B2){_O}", f"(3F10;3B2){_O}", f"(4F7;4I3){_O}", f"(3F11;3I3){_O}",
     f"(4F8;4I4){_O}",
     # 6: 3 x [B0, FB1 def]
     "3B4", f"(4F9;4I5){_O}", "3B5", f"(4F10;4I6){_O}", "3B6", f"(4F11;4I7){_O}",
     # 7: 4 x [B0, B1] | 8: one B0 | 9: six W
     "3B7", "4B8", "3B8", "4B9", "3B9", "4B10", "3B10", "4B11",
     "3B11",
     "4W3", "3W3", "4W4", "4W5", "4W6", "4W7"],
]


def _accepted(p: int) -> range:
    return range(1, 5 * p + 1)  # the generator accepts every m >= 1


def test_golden_p4_m12_cell_for_cell() -> None:
    rows = stp(4, 12).rows()
    assert len(rows) == 4
    for r, (got, want) in enumerate(zip(rows, GOLDEN_P4_M12, strict=True)):
        for c, (g, w) in enumerate(zip(got, want, strict=False)):
            assert g == w, f"rank {r}, cell {c}: got {g}, expected {w}"
        assert len(got) == len(want), f"rank {r}: {len(got)} cells, expected {len(want)}"


@pytest.mark.parametrize("p", RANKS)
def test_validates_for_every_accepted_m(p: int) -> None:
    for m in _accepted(p):
        s = stp(p, m)
        validate(s)  # completeness (m F, B, W per stage), dependencies, deadlock
        assert s.stage_to_rank == v_placement(p)
        assert (s.num_ranks, s.num_microbatches, s.chunks) == (p, m, 2)


@pytest.mark.parametrize("p", RANKS)
def test_only_warmup_forwards_run_alone(p: int) -> None:
    """The STP paper's TP-bubble rule (only warm-up forwards run alone and
    expose their all-reduces): lone forwards are 2(p-r-1) + 2(r+1), plus
    one when r+1 is odd; every B (input grad only) is braided with an F; the
    rest running alone are full backwards (B's all-reduce hides under W) and W
    (no all-reduce)."""
    for m in range(full_phase_min_microbatches(p), 5 * p + 1):
        s = stp(p, m)
        for r, acts in enumerate(s.actions):
            lone = [a for a in acts if isinstance(a, Pass)]
            lone_f = sum(a.kind is Kind.F for a in lone)
            assert lone_f == 2 * (p - r - 1) + 2 * (r + 1) + (r + 1) % 2, (p, m, r)
            assert all(a.kind is not Kind.B for a in lone), (p, m, r)
            ff = [a for a in acts if isinstance(a, Block) and a.passes[1].kind is Kind.F]
            assert len(ff) == (r + 1) // 2, (p, m, r)
        # rank 0 exposes 2p+1 forwards' all-reduces: the table's (2p+1) T_AR
        assert sum(isinstance(a, Pass) and a.kind is Kind.F for a in s.actions[0]) == 2 * p + 1


@pytest.mark.parametrize("p", RANKS)
def test_deferred_w_run_oldest_first(p: int) -> None:
    for m in _accepted(p):
        s = stp(p, m)
        for r in range(p):
            deferred_b = [(x.stage, x.mb) for x in s.passes(r) if x.kind is Kind.B]
            ws = [(x.stage, x.mb) for x in s.passes(r) if x.kind is Kind.W]
            assert ws == deferred_b, (p, m, r)


def _resident_between_blocks(acts: tuple, chunks: int) -> float:
    """Peak of what stays resident after each action ends (the paper's count)."""
    cur = peak = 0.0
    for a in acts:
        alloc, free = action_memory(a, chunks, MemCosts())
        cur += alloc - free
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("p", RANKS)
def test_peak_memory_is_3p_chunk_activations(p: int) -> None:
    """3p M_a between blocks (M_a = 1/2 of our M_B unit), plus one M_a while
    the first braided F+B block of phase 5 has allocated its F and not yet
    freed its B (derivation in gen_stp's docstring)."""
    for m in range(full_phase_min_microbatches(p), 5 * p + 1):
        s = stp(p, m)
        for r in range(p):  # the V placement balances it: 3p M_a on every rank
            assert _resident_between_blocks(s.actions[r], 2) == pytest.approx(1.5 * p)
        assert peak_by_order(s)[0] == pytest.approx((3 * p + 1) / 2), (p, m)
        assert max(peak_by_order(s)) == pytest.approx((3 * p + 1) / 2), (p, m)


@pytest.mark.parametrize("p", RANKS)
def test_small_m_is_the_full_schedule_without_the_extra_microbatches(p: int) -> None:
    m0 = full_phase_min_microbatches(p)
    full = stp(p, m0)
    for m in range(1, m0):
        s = stp(p, m)
        assert s.meta["truncated_from"] == m0
        for r in range(p):
            assert list(s.passes(r)) == [x for x in full.passes(r) if x.mb < m], (p, m, r)
            # a kept block still braids two passes of microbatches < m
            for a in s.actions[r]:
                assert all(x.mb < m for x in passes_of(a))


def test_meta_for_later_layers() -> None:
    s = stp(4, 12)
    assert s.meta["chunks"] == 2
    assert s.meta["truncated_from"] is None


def test_registry_generates_it() -> None:
    assert generate("stp", 4, 12).rows() == GOLDEN_P4_M12
    assert generate("stp", 4, 1).num_microbatches == 1


@pytest.mark.parametrize("m", [0, -3])
def test_refuses_m_below_minimum(m: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        stp(4, m)
    with pytest.raises(ValueError, match="at least 1"):
        generate("stp", 4, m)


def test_refuses_bad_rank_count() -> None:
    with pytest.raises(ValueError, match="pp >= 1"):
        stp(0, 4)
    with pytest.raises(ValueError, match="pp >= 1"):
        generate("stp", 0, 4)
