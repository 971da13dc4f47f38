"""The torch CSV both ways for the schedules PyTorch ships that stp added,
OVERLAP_F_B rows included, on the golden grid of tests/schedule/test_gen_torch.py:

* PyTorch's own class dumps its compute-only CSV (`_dump_csv`); stp reads
  it (`io.load_csv`: DualPipeV's `(F;B)OVERLAP_F_B` cells become braided
  blocks) and gets exactly its own generated schedule;
* stp's CSV is loaded by the same PyTorch class (`_load_csv`: its
  `_validate_schedule` and the lowering to sends and receives) and gives
  back PyTorch's own order; its dry run of the lowered schedule
  (`_simulate_comms_compute`) runs every action without hanging.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import schedules as ts  # noqa: E402

from stp.schedule import Block, generate, io  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "schedule"))
from test_gen_torch import GOLDEN, TORCH_CLASSES, stand_in_stages, torch_rows  # noqa: E402

CASES = [(name, p, m) for name, v, p, m in GOLDEN if v == 2]


def _torch_schedule(name: str, p: int, m: int):
    return TORCH_CLASSES[name](stand_in_stages(p, 2), m)


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_torch_csv_both_ways(name, p, m, tmp_path):
    ours = generate(name, p, m)
    theirs = _torch_schedule(name, p, m)
    path = tmp_path / "torch.csv"
    theirs._dump_csv(str(path), format="compute_only")
    read = io.load_csv(path, num_microbatches=m)
    assert read.actions == ours.actions and read.stage_to_rank == ours.stage_to_rank

    ours_path = tmp_path / "stp.csv"
    ours_path.write_text(io.dump_csv(ours))
    loader = _torch_schedule(name, p, m)
    loader.pipeline_order = {}
    loader._load_csv(str(ours_path))  # validates, maps stages, lowers to comms
    got = [[str(a) for a in loader.pipeline_order[r] if a is not None] for r in range(p)]
    assert got == torch_rows(name, p, m)


def _expanded(order):
    """OVERLAP_F_B -> its sub-actions: what PyTorch's runtime runs without a
    registered overlap function, and what its dry run understands."""
    return {r: [s for a in acts for s in (a.sub_actions if a.sub_actions else (a,))]
            for r, acts in order.items()}


@pytest.mark.parametrize(("name", "p", "m"), [c for c in CASES if c[1] <= 4])
def test_torch_dry_run_of_our_csv(name, p, m):
    sch = generate(name, p, m)
    order = {r: [ts._Action.from_str(c) for c in row] for r, row in enumerate(sch.rows())}
    mapping = ts._validate_schedule(order, p, sch.num_stages, m)
    lowered = ts._add_send_recv(order, lambda s: mapping[s], sch.num_stages)
    timeline = ts._simulate_comms_compute(_expanded(lowered), lambda s: mapping[s],
                                          sch.num_stages)
    ran = {str(a) for acts in timeline.values() for a in acts if a is not None}
    assert {str(q) for r in range(p) for q in sch.passes(r)} <= ran
    if name == "dualpipev":
        assert any(isinstance(a, Block) for acts in sch.actions for a in acts)
        assert any("OVERLAP_F_B" in c for row in sch.rows() for c in row)


REFUSED = [(name, p, m) for name in ("zb-interleaved", "dualpipev") for p in (2, 4, 8)
           for m in range(1, 4 * p + 1) if torch_rows(name, p, m) is None]


@pytest.mark.parametrize(("name", "p", "m"), REFUSED)
def test_torch_validates_our_csv_where_its_class_refuses(name, p, m):
    """PyTorch's class refuses these (p, m), but its schedule validation and
    lowering accept stp's schedule for them, read from our CSV."""
    sch = generate(name, p, m)
    order = {r: [ts._Action.from_str(c) for c in row] for r, row in enumerate(sch.rows())}
    mapping = ts._validate_schedule(order, p, sch.num_stages, m)
    assert [mapping[s] for s in range(sch.num_stages)] == list(sch.stage_to_rank)
    ts._add_send_recv(order, lambda s: mapping[s], sch.num_stages)
