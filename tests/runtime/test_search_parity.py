"""Parity: a schedule found by `stp search` (V placement, braided blocks) runs in
the distributed Trainer with the loss, gradients and parameters of the
single-process reference (float64, tolerance 1e-9 as test_parity.py)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_dist

from stp.models import ModelConfig, build_reference
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import Block, Schedule, v_placement, validate
from stp.search import search
from stp.sim import Costs
from stp.trainer import Trainer

CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
SEQ, PP, M = 8, 2, 4
TOL = 1e-9


def _found() -> Schedule:
    # A TP all-reduce as large as the passes: the search braids blocks.
    got = search(PP, M, Costs(2, 2, 2, ar=1.5), memory_limit=3, braided="on",
                 placement_kind="v", time_limit=5)
    return got.schedule


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, CONFIG.vocab_size, (M, SEQ + 1), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-300)) for n in b)


def _worker(rank: int, world: int, schedule: Schedule) -> dict | None:
    mesh = Mesh.from_world(ParallelDims(PP, 1, 1), timeout=60)
    trainer = Trainer(CONFIG, _sgd, schedule, mesh=mesh, dtype=torch.float64, timeout=60)
    batches = [_batch(step) for step in range(2)]
    losses = [trainer.step(batches[0])]
    grads = trainer.full_state_dict(grads=True)
    losses.append(trainer.step(batches[1]))
    params = trainer.full_state_dict()
    if rank != 0:
        return None
    ref = build_reference(CONFIG, torch.float64)
    opt = _sgd(list(ref.parameters()))
    ref_losses, ref_grads = [], {}
    for step, (tokens, targets) in enumerate(batches):
        opt.zero_grad()
        loss = ref.loss(tokens, targets)
        loss.backward()
        ref_losses.append(loss.item())
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        "grad": _rel(grads, ref_grads),
        "param": _rel(params, ref_params),
    }


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
