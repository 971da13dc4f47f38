"""Full activation recomputation on Hugging Face models loaded with init_from (built
by transformers, nothing downloaded), at pp2 x tp2 with ignored targets: the Llama
(vocabulary padded under tp 2, 2 kv heads split, Llama 3 rope, head_dim 12) under
the braided stp schedule, the Qwen2 (tied embedding and head on different pipeline
ranks, one kv head replicated, q/k/v biases) under 1f1b. Two SGD steps: losses,
first-step gradients and final parameters equal the single-process model within
1e-9 in float64 (the criterion of test_hf_dist)."""

from __future__ import annotations

from pathlib import Path

import torch
from _dist import run_dist
from test_hf_dist import _batch, _compare, _sgd

TOL = 1e-9
CASES = [("llama", "stp", "full"), ("qwen2", "1f1b", "full")]


def _worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(2, 2, 1), timeout=60)
    results = {}
    for kind, schedule, mode in CASES:
        trainer = Trainer(None, _sgd, schedule, mesh=mesh, microbatches=4,
                          dtype=torch.float64, timeout=60, init_from=paths[kind],
                          recompute=mode)
        losses = [trainer.step(_batch(0))]
        grads = trainer.full_state_dict(grads=True)
        losses.append(trainer.step(_batch(1)))
        params = trainer.full_state_dict()
        if rank == 0:
            results[(kind, schedule, mode)] = _compare(paths[kind], losses, grads, params)
    return results


def test_llama_and_qwen2_with_full_recomputation_equal_one_process(
    checkpoints: dict[str, Path]
) -> None:
    paths = {k: str(v) for k, v in checkpoints.items()}
    results = run_dist(_worker, 4, paths, timeout=300)[0]
    assert sorted(results) == sorted(CASES)
    for case, diffs in sorted(results.items()):
        print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
        assert max(diffs.values()) < TOL, (case, diffs)
