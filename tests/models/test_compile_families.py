"""`compile=True` on the other model families, in one process (pp1): the
mixture-of-experts model (its norms compiled, the experts eager) and the
multimodal model (its decoder units compiled, the vision encoder eager) train
two float64 SGD steps to the eager run's losses, first gradients and
parameters within 1e-10, with ZB-H1's deferred W. Behind `-m slow` (each
family compiles its own shapes)."""

from __future__ import annotations

import pytest
import torch
from _parity import random_batch, rel, sgd, two_steps

from stp.shapes.moe import MoEConfig
from stp.train.step.trainer import Trainer

MOE = MoEConfig(
    vocab_size=32, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3, init_std=0.2, num_experts=4, top_k=2, expert_ffn=16,
    shared_expert_ffn=24, norm_topk_prob=False, aux_loss_coef=0.1,
)
SAME = 1e-10


def _mllm():
    from stp.train.families.mllm import mllm_batches
    from stp.train.run.config import ModelShape, TrainJob, VisionShape
    from stp.train.run.job import model_config

    job = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=12),
                   vision=VisionShape(image_size=8, patch=2, vision_layers=2,
                                      vision_hidden=8),
                   microbatches=2, microbatch_size=1, dtype="float64")
    cfg = model_config(job)
    data = mllm_batches(job, cfg)
    return cfg, [data.batch(s) for s in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["moe", "mllm"])
def test_other_families_compile_to_the_eager_numbers(family: str) -> None:
    if family == "moe":
        config, batches = MOE, [random_batch(32, 2, 8, s) for s in range(2)]
    else:
        config, batches = _mllm()
    runs = {compiled: two_steps(Trainer(config, sgd, "zb-h1", pp=1, microbatches=2,
                                        dtype=torch.float64, compile=compiled), batches)
            for compiled in (False, True)}
    (losses, grads, params), (c_losses, c_grads, c_params) = runs[False], runs[True]
    assert max(abs(a - b) / abs(b) for a, b in zip(c_losses, losses, strict=True)) <= SAME
    assert rel(c_grads, grads) <= SAME
    assert rel(c_params, params) <= SAME
