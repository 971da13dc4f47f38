"""Parity: a schedule found by `stp search` (V placement, braided blocks) runs in
the distributed Trainer with the loss, gradients and parameters of the
single-process reference (float64, tolerance 1e-9 as test_parity.py).

Broken variant (default suite): a bug planted in the runtime's braided path
only (a backward in a block starts from twice its output gradient) fails
the same comparison: the blocks the search formed are run,
and run through the code the comparison checks."""

from __future__ import annotations

import pytest
import torch
from _dist import run_dist
from _parity import compare_with_reference, random_batch, sgd, two_steps

from stp.models import ModelConfig
from stp.runtime.braid import UnitRunner
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import Block, Kind, Schedule, v_placement, validate
from stp.search import search
from stp.sim import Costs
from stp.train.step.trainer import Trainer

CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
SEQ, PP, M = 8, 2, 4
TOL = 1e-9


def _found() -> Schedule:
    # A TP all-reduce as large as the passes: the search braids blocks. A
    # budget of candidates (braided from about 20), not a time limit: the same
    # schedule on any machine.
    got = search(PP, M, Costs(2, 2, 2, ar=1.5), memory_limit=3, braided="on",
                 placement_kind="v", time_limit=600, max_evaluations=50)
    return got.schedule


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(CONFIG.vocab_size, M, SEQ, step)


def _doubled_in_blocks(plain):
    def begin(self, ch) -> None:
        plain(self, ch)
        braided = self._where[1]
        if braided and ch.p.kind in (Kind.B, Kind.BW):
            ch.value = ch.value * 2

    return begin


def _worker(rank: int, world: int, schedule: Schedule, broken: bool = False) -> dict | None:
    if broken:
        UnitRunner._begin = _doubled_in_blocks(UnitRunner._begin)  # this process only
    mesh = Mesh.from_world(ParallelDims(PP, 1, 1), timeout=60)
    trainer = Trainer(CONFIG, sgd, schedule, mesh=mesh, dtype=torch.float64, timeout=60)
    batches = [_batch(step) for step in range(2)]
    losses, grads, params = two_steps(trainer, batches)
    if rank != 0:
        return None
    return compare_with_reference(CONFIG, torch.float64, batches, losses, grads, params)


def test_found_schedule_is_braided_v_and_valid():
    sch = _found()
    validate(sch, memory_limit=3)
    assert sch.stage_to_rank == v_placement(PP)
    assert any(isinstance(a, Block) for acts in sch.actions for a in acts)


@pytest.mark.slow
def test_searched_schedule_matches_the_reference():
    res = run_dist(_worker, PP, _found(), timeout=240)[0]
    bad = [f"{k} differs by {res[k]:.3g}" for k in ("loss", "grad", "param") if not res[k] <= TOL]
    assert not bad, "; ".join(bad)


def test_bug_in_braided_blocks_fails_the_comparison():
    res = run_dist(_worker, PP, _found(), True, timeout=240)[0]
    assert res["grad"] > TOL and res["param"] > TOL, res
