"""Trainer(init_from=DIR) on meshes equals the single-process model, with ignored
targets; Trainer.save_hf on a mesh writes the checkpoint back bit for bit.

One spawn of 4 gloo ranks runs both meshes:
- pp2 x tp2, schedule stp: Llama's vocabulary of 99 padded to 100, its 2 kv
  heads split; Qwen2's one kv head replicated on both TP ranks, its tied
  embedding and head on pipeline rank 0 (the V puts stage 0 and stage 3 there);
- pp2 x dp2, schedule 1f1b: the tied embedding (rank 0) and head (rank 1)
  exchange gradients.
Targets of -100 fall unevenly over microbatches and replicas (one microbatch
almost all ignored); the loss is the mean over the valid tokens of the whole
global batch. Two SGD-with-momentum steps: the losses, every gradient after
the first and every parameter after both equal stp.models.hf.load run on the
whole batch, float64, within 1e-9 (observed ~1e-15).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_dist

from stp.models import hf

F64 = torch.float64
TOL = 1e-9
MESHES = {(2, 2, 1): "stp", (2, 1, 2): "1f1b"}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(0, 96, (8, 16), generator=g)
    targets = torch.randint(0, 96, (8, 16), generator=g)
    targets[0, :12] = -100
    targets[1] = -100  # microbatch 0 (rows 0, 1) keeps 4 of 32 targets
    targets[6, 5:9] = -100
    return tokens, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _reference(path: str) -> tuple[list[float], dict, dict]:
    model = hf.load(path, dtype=F64)
    opt = _sgd(list(model.parameters()))
    losses, grads = [], {}
    for step in range(2):
        opt.zero_grad()
        loss = model.loss(*_batch(step))
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(path: str, losses: list[float], grads: dict, params: dict) -> dict[str, float]:
    ref_losses, ref_grads, ref_params = _reference(path)
    if "head.weight" not in ref_grads and "head.weight" in grads:  # tied: one tensor
        ref_grads["head.weight"], ref_params["head.weight"] = (
            ref_grads["embed.weight"], ref_params["embed.weight"])
    assert sorted(grads) == sorted(ref_grads)
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        "grad": max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
        "param": max(_rel(params[n], ref_params[n]) for n in ref_params),
    }


def _same_files(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    ta = {k: v for f in a.glob("*.safetensors") for k, v in load_file(f).items()}
    tb = {k: v for f in b.glob("*.safetensors") for k, v in load_file(f).items()}
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _worker(rank: int, world: int, paths: dict[str, str], out_dir: str) -> dict:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    results: dict[str, object] = {}
    for dims, schedule in MESHES.items():
        mesh = Mesh.from_world(ParallelDims(*dims), timeout=60)
        for kind, path in paths.items():
            trainer = Trainer(None, _sgd, schedule, mesh=mesh, microbatches=4, dtype=F64,
                              timeout=60, init_from=path)
            if dims == (2, 2, 1):  # untrained: the files come back as they were
                saved = Path(out_dir) / kind
                trainer.save_hf(saved, max_shard_bytes=20_000)
                if rank == 0:
                    results[f"{kind} round trip"] = _same_files(Path(path), saved)
            losses = [trainer.step(_batch(0))]
            grads = trainer.full_state_dict(grads=True)
            losses.append(trainer.step(_batch(1)))
            params = trainer.full_state_dict()
            if rank == 0:
                results[f"{kind} {dims}"] = _compare(path, losses, grads, params)
    return results


@pytest.mark.slow
def test_meshes_equal_one_process_and_save_round_trips(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    paths = {k: str(v) for k, v in checkpoints.items()}
    results = run_dist(_worker, 4, paths, str(tmp_path), timeout=300)[0]
    for kind in paths:
        assert results[f"{kind} round trip"] is True, kind
        for dims in MESHES:
            diffs = results[f"{kind} {dims}"]
            assert max(diffs.values()) < TOL, (kind, dims, diffs)
