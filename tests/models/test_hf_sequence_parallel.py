"""Sequence parallelism on Hugging Face models loaded with init_from: a Llama (vocabulary
of 99 padded to 100, 2 kv heads split, Llama 3 rope, head_dim 12) and a Qwen2 (tied
embedding and head, one kv head replicated on both TP ranks, q/k/v biases), built by
transformers, at pp2 x tp2 with the stp schedule and with 1f1b, ignored targets
included. Two SGD steps: losses, first-step gradients and final parameters equal
the single-process model within 1e-9 in float64 (the criterion of test_hf_dist)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_dist
from test_hf_dist import _batch, _compare, _sgd

TOL = 1e-9


def _worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(2, 2, 1), timeout=60)
    results = {}
    for kind, path in paths.items():
        for schedule in ("stp", "1f1b"):
            trainer = Trainer(None, _sgd, schedule, mesh=mesh, microbatches=4,
                              dtype=torch.float64, timeout=60, init_from=path,
                              sequence_parallel=True)
            losses = [trainer.step(_batch(0))]
            grads = trainer.full_state_dict(grads=True)
            losses.append(trainer.step(_batch(1)))
            params = trainer.full_state_dict()
            if rank == 0:
                results[(kind, schedule)] = _compare(path, losses, grads, params)
    return results


@pytest.mark.slow
def test_llama_and_qwen2_with_sequence_parallel_equal_one_process(
    checkpoints: dict[str, Path]
) -> None:
    paths = {k: str(v) for k, v in checkpoints.items()}
    results = run_dist(_worker, 4, paths, timeout=300)[0]
    assert len(results) == 4, sorted(results)
    for case, diffs in sorted(results.items()):
        print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
        assert max(diffs.values()) < TOL, (case, diffs)
