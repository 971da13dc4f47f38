"""stp's runtime against PyTorch's own (torch.distributed.pipelining), float64.

The peer benchmark (stp.bench.peer, benchmarks/bench_vs_torch.py) times the two
runtimes on the same model; this checks they compute the same thing. With the
same initial weights and batch, one step of stp's Trainer and one step of
PyTorch's schedule (its own class for the name, and `_PipelineScheduleRuntime`
fed stp's exported CSV) give the same loss and, on every rank, the same
gradient for every parameter, to 1e-12 relative. The torch side's plain module
is first checked against stp's single-process reference model. Broken variant,
in the same spawn: stp's executor giving each microbatch's loss the next
microbatch's targets must fail the comparison.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.pipelining")

import torch  # noqa: E402
from _dist import run_dist  # noqa: E402

from stp.bench.peer_torch import DecoderPart, TorchSide, lm_loss  # noqa: E402
from stp.models import ModelConfig, build_reference  # noqa: E402
from stp.schedule import registry  # noqa: E402
from stp.schedule.placement import stage_layers  # noqa: E402
from stp.train.step.trainer import Trainer  # noqa: E402

CONFIG = ModelConfig(vocab_size=64, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     ffn_hidden=64, max_seq_len=16, seed=5)
SEQ, MBS, M = 12, 2, 4
TOL = 1e-12
CASES = [("1f1b", False), ("1f1b", True), ("1f1b-interleaved", False), ("zb-v", False),
         ("zb-v", True), ("looped-bfs", False), ("zb-interleaved", False),
         ("dualpipev", False), ("dualpipev", True)]
BROKEN = ("1f1b", False, "next targets")
"""A case run with a bug planted in stp's side (its executor only)."""


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CONFIG.vocab_size, (M * MBS, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _no_step(params):
    return torch.optim.SGD(params, lr=0.0)


def test_decoder_part_equals_the_reference_model():
    """Four DecoderParts in a chain = build_reference: loss and every gradient."""
    tokens, targets = _batch()
    ref = build_reference(CONFIG, torch.float64)
    ref_loss = ref.loss(tokens, targets)
    ref_loss.backward()
    n = 4
    parts = [DecoderPart(CONFIG, stage_layers(CONFIG.num_layers, s, n), first=s == 0,
                         last=s == n - 1, dtype=torch.float64) for s in range(n)]
    x = tokens
    for part in parts:
        x = part(x)
    loss = lm_loss(x, targets)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    grads = {k: p.grad for part in parts for k, p in part.named_parameters()}
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads)
    worst = max(_rel(grads[k], ref_grads[k]) for k in ref_grads)
    assert worst <= TOL, worst


def _compare_worker(rank: int, world: int) -> dict[str, tuple[float, float, int]]:
    tokens, targets = _batch()
    out = {}
    for name, from_csv, *bug in [*CASES, BROKEN]:
        schedule = registry.make(name, world, M)
        trainer = Trainer(CONFIG, _no_step, schedule, pp=world, dtype=torch.float64,
                          timeout=60)
        if bug:  # planted: microbatch mb's loss gets microbatch mb + 1's targets
            ex = trainer.parts.executor
            ex.runner.targets = lambda mb, ex=ex: ex._targets[(mb + 1) % M]
        side = TorchSide(name, schedule, rank, CONFIG, torch.float64, _no_step,
                         from_csv=from_csv)
        stp_loss = trainer.step((tokens, targets))
        torch_loss = side.step(tokens, targets)
        mine = {k: p.grad for k, p in trainer.named_parameters()}
        theirs = {k: p.grad for k, p in side.named_parameters()}
        assert set(mine) == set(theirs), sorted(set(mine) ^ set(theirs))
        assert all(g is not None and g.abs().max() > 0 for g in theirs.values())
        worst = max(_rel(mine[k], theirs[k]) for k in theirs)
        label = f"{name}{' csv' if from_csv else ''}{' broken' if bug else ''}"
        out[label] = (abs(stp_loss - torch_loss) / abs(torch_loss), worst, len(theirs))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[float, float, int]]]:
    return run_dist(_compare_worker, 2, timeout=120)


def test_torch_runtime_gives_stps_loss_and_gradients(results):
    for rank, all_cases in enumerate(results):
        per_case = {k: v for k, v in all_cases.items() if not k.endswith(" broken")}
        assert len(per_case) == len(CASES)
        for label, (loss_diff, grad_diff, count) in per_case.items():
            assert count > 0, (rank, label)
            assert loss_diff <= TOL, (rank, label, loss_diff)
            assert grad_diff <= TOL, (rank, label, grad_diff)


def test_planted_bug_fails_the_comparison(results):
    for rank, per_case in enumerate(results):
        loss_diff, grad_diff, _ = per_case["1f1b broken"]
        # every rank's gradients differ; the loss at least on the rank computing it
        assert grad_diff > TOL and (rank == 0 or loss_diff > TOL), (rank, loss_diff, grad_diff)
