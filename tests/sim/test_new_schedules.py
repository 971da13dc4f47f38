"""The simulator on looped-bfs, zb-interleaved and dualpipev: the papers'
bubble formulas, peak memories, and a DualPipeV pair braided.

Costs are whole-rank shares (`stp.sim.costs`); a chunk pass takes 1/v of
them, so `T_F = f / v` etc. are the papers' per-chunk times.
"""

from __future__ import annotations

import itertools

import pytest

from stp.schedule import generate
from stp.sim import Costs, simulate

COSTS = [Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 1, 0.5), Costs(3, 1, 2)]


@pytest.mark.parametrize(("c", "p", "v"), itertools.product(COSTS, (2, 3, 4, 8), (2, 3)))
def test_looped_bfs_bubble(c, p, v):
    """"Breadth-First Pipeline Parallelism" (arXiv 2211.05953): the looped
    breadth-first schedule has the depth-first bubble (p-1)(T_F+T_B+T_W)/v
    once m >= p; below that each later loop waits (p-m) chunk slots more."""
    per_chunk = (c.f + c.b + c.w) / v
    for m in range(1, 3 * p + 2):
        res = simulate(generate("looped-bfs", p, m, chunks=v), c)
        want = (p - 1) * per_chunk + (v - 1) * max(0, p - m) * per_chunk
        assert res.pp_bubble == pytest.approx(want)
        # breadth first: every forward before any backward, as GPipe
        assert res.peak_activation == pytest.approx([m] * p)


@pytest.mark.parametrize(("c", "p", "v"), itertools.product(
    COSTS[:3] + [Costs(2, 2, 1), Costs(1, 1, 0.5)], (2, 3, 4, 8), (2, 3)))
def test_zb_interleaved_bubble(c, p, v):
    """ZB-H1's bubble (p-1)(T_F+T_B-T_W) ("Zero Bubble Pipeline
    Parallelism", arXiv 2401.10241) over v chunks, for m a multiple of p."""
    for m in (p, 2 * p, 3 * p, 4 * p):
        res = simulate(generate("zb-interleaved", p, m, chunks=v), c)
        assert res.pp_bubble == pytest.approx((p - 1) * (c.f + c.b - c.w) / v)


def test_zb_interleaved_peak():
    """Rank r holds its warm-up plus one: ((v-1)p + p - r) chunk activations."""
    for p, v in itertools.product((2, 4, 8), (2, 3)):
        res = simulate(generate("zb-interleaved", p, 2 * p, chunks=v), Costs())
        assert res.peak_activation == pytest.approx([((v - 1) * p + p - r) / v
                                                     for r in range(p)])


# Chunk-time points where the DualPipeV bubble is linear in the costs (the
# order of the drain does not change): T_W <= T_B <= T_F < T_B + T_W, checked
# on p = 2, 3, 4, 8 (at p = 8, T_B = 5/4 T_F or T_B + T_W = T_F leave it).
DUALPIPEV_COSTS = [Costs(1, 1, 1), Costs(1, 1, 0.5), Costs(1, 0.75, 0.75), Costs(1, 0.75, 0.5),
                   Costs(2, 2, 1), Costs(1, 1, 0.75)]


@pytest.mark.parametrize(("c", "p"), itertools.product(DUALPIPEV_COSTS, (2, 3, 4, 8)))
def test_dualpipev_bubble_against_readme(c, p):
    """The DualPipe README gives DualPipeV's bubble as (PP/2-1)(F&B+B-3W):
    PP stages on p = PP/2 ranks, B a chunk's full backward, F&B an
    overlapped pair (here braided; with no TP all-reduce to hide it takes
    F+B). PyTorch's order, simulated, does better by (p-1)(T_B - T_F/2)
    (T_B the input-gradient part): its critical rank 0 waits
    (p-1)(3T_F/2 + T_B - T_W), for every m >= 2p."""
    tf, tb, tw = c.f / 2, c.b / 2, c.w / 2
    f_and_b, full_b = tf + tb + tw, tb + tw
    readme = (p - 1) * (f_and_b + full_b - 3 * tw)
    for m in (2 * p, 2 * p + 1, 3 * p + 1, 4 * p):
        res = simulate(generate("dualpipev", p, m), c)
        assert res.critical_rank.rank == 0
        assert res.pp_bubble == pytest.approx((p - 1) * (1.5 * tf + tb - tw))
        assert res.pp_bubble == pytest.approx(readme - (p - 1) * (tb - tf / 2))
        # the README's activation column, PP+1 chunks: (2p+1)/2 M_B on every rank
        assert res.peak_activation == pytest.approx([p + 0.5] * p)


def test_dualpipev_pair_braided_hides_allreduce():
    """A braided pair hides TP all-reduce under its partner: DualPipeV's TP
    bubble is well under that of the same order run pass by pass, and so
    is its makespan. With nothing to hide (ar = 0) braiding adds no work
    and no TP wait, but a braided pass's output is final only when its last
    unit has run, near the end of the pair, later than pass by pass; on
    DualPipeV's critical path that costs time (here 86 against 84.5)."""
    from dataclasses import replace

    from stp.schedule import Block

    p, m = 4, 16
    sch = generate("dualpipev", p, m)
    flat = replace(sch, actions=tuple(
        tuple(q for a in acts for q in (a.passes if isinstance(a, Block) else (a,)))
        for acts in sch.actions))
    zero = Costs(2, 2, 1)
    b0, s0 = simulate(sch, zero), simulate(flat, zero)
    assert [r.compute for r in b0.ranks] == pytest.approx([r.compute for r in s0.ranks])
    assert b0.tp_bubble == s0.tp_bubble == 0
    assert (b0.makespan, s0.makespan) == pytest.approx((86.0, 84.5))
    for ar in (0.4, 0.8):
        c = Costs(2, 2, 1, ar=ar)
        braided, sequential = simulate(sch, c, layers=2), simulate(flat, c, layers=2)
        assert braided.tp_bubble < 0.5 * sequential.tp_bubble
        assert braided.makespan < sequential.makespan
