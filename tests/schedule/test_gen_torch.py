"""looped-bfs, zb-interleaved and dualpipev against PyTorch's own classes.

PyTorch's ScheduleLoopedBFS, ScheduleInterleavedZeroBubble and
ScheduleDualPipeV build every rank's `pipeline_order` in their constructor
from a handful of stage attributes, so light stand-ins take the place of
`PipelineStage` (no process group, no model). Their orders, bubbles (None)
dropped, must equal stp's action for action on pp in {2, 4, 8} and every m
from the smallest PyTorch accepts to 4 pp (126 cases at two chunks per rank;
more at three and four); where PyTorch refuses m, stp's schedule is valid
and differs as its generator says.
"""

from __future__ import annotations

import logging
from functools import cache
from types import SimpleNamespace

import pytest

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import schedules as ts  # noqa: E402

from stp.schedule import Block, Kind, generate, validate  # noqa: E402
from stp.schedule.gen_zb_interleaved import torch_accepts  # noqa: E402

TORCH_CLASSES = {
    "looped-bfs": ts.ScheduleLoopedBFS,
    "zb-interleaved": ts.ScheduleInterleavedZeroBubble,
    "dualpipev": ts.ScheduleDualPipeV,
}
PPS = (2, 4, 8)


def stand_in_stages(num_ranks: int, chunks: int) -> list[SimpleNamespace]:
    """What PyTorch's schedule constructors read from their stages."""
    return [
        SimpleNamespace(num_stages=num_ranks * chunks, group_size=num_ranks, group_rank=0,
                        submod=None, stage_index=c * num_ranks)
        for c in range(chunks)
    ]


@cache
def torch_rows(name: str, p: int, m: int, chunks: int = 2) -> list[list[str]] | None:
    """PyTorch's per-rank compute order as action strings, or None where its
    constructor refuses (p, m)."""
    logging.disable(logging.WARNING)  # its bubble-insertion pass logs per call
    try:
        sched = TORCH_CLASSES[name](stand_in_stages(p, chunks), m)
    except ValueError:
        return None
    finally:
        logging.disable(logging.NOTSET)
    return [[str(a) for a in sched.pipeline_order[r] if a is not None] for r in range(p)]


def _grid(name: str, chunks: int, pps: tuple[int, ...] = PPS) -> list[tuple[int, int]]:
    return [(p, m) for p in pps for m in range(1, 4 * p + 1)
            if torch_rows(name, p, m, chunks) is not None]


def _options(name: str, chunks: int) -> dict[str, int]:
    return {} if name == "dualpipev" else {"chunks": chunks}


GOLDEN = [(name, 2, p, m) for name in TORCH_CLASSES for p, m in _grid(name, 2)]
GOLDEN += [(name, v, p, m) for name in ("looped-bfs", "zb-interleaved") for v in (3, 4)
           for p, m in _grid(name, v, (2, 4))]


def test_golden_grid_counts():
    """The cases the module docstring counts: PyTorch's minimum m to 4 pp."""
    two = [c for c in GOLDEN if c[1] == 2]
    per_name = {n: sum(1 for c in two if c[0] == n) for n in TORCH_CLASSES}
    # LoopedBFS takes every m; InterleavedZeroBubble refuses m that its
    # rounds (m // p) do not divide; DualPipeV needs m >= 2p
    assert per_name == {"looped-bfs": 8 + 16 + 32, "zb-interleaved": 6 + 12 + 23,
                        "dualpipev": 5 + 9 + 17}
    assert len(two) == 128


@pytest.mark.parametrize(("name", "chunks", "p", "m"), GOLDEN)
def test_order_equals_torch(name, chunks, p, m):
    sch = generate(name, p, m, **_options(name, chunks))
    validate(sch)
    assert sch.rows() == torch_rows(name, p, m, chunks)


REFUSED = [(name, p, m) for name in ("zb-interleaved", "dualpipev") for p in PPS
           for m in range(1, 4 * p + 1) if torch_rows(name, p, m) is None]


@pytest.mark.parametrize(("name", "p", "m"), REFUSED)
def test_where_torch_refuses_stp_is_valid(name, p, m):
    sch = generate(name, p, m)
    validate(sch)
    assert sch.meta["torch_order"] is False
    if name == "zb-interleaved":
        # uneven groups, larger first, sizes differing by one
        groups = sch.meta["groups"]
        assert sum(groups) == m and max(groups) - min(groups) == 1
        assert list(groups) == sorted(groups, reverse=True)
    else:
        # m < 2p: the 2p schedule with microbatches m.. dropped
        assert m < 2 * p
        full = generate(name, p, 2 * p)
        for r in range(p):
            kept = [q for q in full.passes(r) if q.mb < m]
            assert list(sch.passes(r)) == kept


def test_torch_accepts_matches_torch():
    for p in PPS:
        for m in range(1, 4 * p + 1):
            assert torch_accepts(p, m) == (torch_rows("zb-interleaved", p, m) is not None)


def test_dualpipev_pairs_are_braided_blocks():
    """Every overlapped pair is a Block of a forward and a full backward on
    the rank's other chunk; the last rank's first main-step pair is not
    overlapped (DualPipe's exception), nor anything outside steps 4 and 5."""
    p, m = 4, 12
    sch = generate("dualpipev", p, m)
    for r in range(p):
        blocks = [a for a in sch.actions[r] if isinstance(a, Block)]
        for b in blocks:
            f, bw = b.passes
            assert f.kind is Kind.F and bw.kind is Kind.BW
            assert {f.stage, bw.stage} == {r, 2 * p - 1 - r}
        main = m - 2 * p + r + 1
        pairs = 2 * main + (p - r - 1) - (1 if r == p - 1 else 0)
        assert len(blocks) == pairs


def test_bad_chunks_refused_in_one_line():
    with pytest.raises(ValueError, match=r"zb-interleaved: chunks=1 not accepted; it needs an "
                                         r"integer >= 2"):
        generate("zb-interleaved", 2, 4, chunks=1)
    with pytest.raises(ValueError, match=r"looped-bfs: chunks=0 not accepted"):
        generate("looped-bfs", 2, 4, chunks=0)
    with pytest.raises(TypeError):
        generate("dualpipev", 2, 4, chunks=2)


@pytest.mark.parametrize(("name", "chunks"), [("looped-bfs", 1), ("looped-bfs", 2),
                                              ("looped-bfs", 3), ("zb-interleaved", 2),
                                              ("zb-interleaved", 3), ("zb-interleaved", 4),
                                              ("dualpipev", 2)])
def test_valid_for_every_small_case(name, chunks):
    """Valid (complete, in dependency order, deadlock-free), PyTorch's (p, m)
    or not: every m up to 2p+2, and 3p+1 and 4p, on p in {1, 2, 3, 5, 8}
    (every p <= 8 and m <= 4p was checked when the generators were written)."""
    for p in (1, 2, 3, 5, 8):
        for m in sorted({*range(1, 2 * p + 3), 3 * p + 1, 4 * p}):
            sch = generate(name, p, m, **_options(name, chunks))
            validate(sch)
            assert sch.chunks == chunks
