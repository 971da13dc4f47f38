"""Shared by the parity tests: run a Trainer for two steps and compare with the
single-process reference on the same model, data and optimizer (the decoder's,
and the multimodal model's: `mllm_setup`, `mllm_reference`)."""

from __future__ import annotations

import torch

from stp.models import ModelConfig, build_reference

LEVER_MODELS = {
    "untied": ModelConfig(
        vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=64,
        max_seq_len=16, seed=3),
    "tied": ModelConfig(
        vocab_size=30, hidden=32, num_layers=4, num_heads=4, num_kv_heads=1, ffn_hidden=64,
        max_seq_len=16, seed=5, tie_embeddings=True, qkv_bias=True),
}
"""The two tiny decoders the lever matrices (recompute, compile) run: plain, and tied
embeddings with a QKV bias."""

LeverCase = tuple[tuple[int, int, int], str, str, bool, str, str]
"""(mesh (pp, tp, dp), schedule, recompute, sequence parallel, offload, model)."""


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def random_batch(vocab: int, rows: int, seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference of any tensor, relative to that tensor's largest magnitude."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-300)) for n in b)


def two_steps(trainer, batches) -> tuple[list[float], dict, dict | None]:
    """Losses of two steps, gradients after the first, parameters after both."""
    losses = [trainer.step(batches[0])]
    grads = trainer.full_state_dict(grads=True)
    losses.append(trainer.step(batches[1]))
    return losses, grads, trainer.full_state_dict()


def compare_with_reference(
    config: ModelConfig, dtype: torch.dtype, batches, losses, grads, params
) -> dict[str, float]:
    """Relative differences of loss, first-step gradients and final parameters."""
    ref = build_reference(config, dtype)
    opt = sgd(list(ref.parameters()))
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
        "grad": rel(grads, ref_grads),
        "param": rel(params, ref_params),
    }


def mllm_setup(rows: int = 4):
    """A tiny multimodal model (float64) and its caption batches of `rows` samples:
    16 image tokens + 6 caption tokens, so under sequence parallelism at tp 2 the image
    rows are cut between the two TP ranks (11 rows each; rank 1 holds 5 image rows
    and the caption)."""
    from stp.train.data.images import CaptionBatches, ShapeImages
    from stp.train.run.config import ModelShape, TrainJob, VisionShape
    from stp.train.run.job import model_config

    job = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=6),
                   vision=VisionShape(image_size=16, patch=2, vision_layers=2,
                                      vision_hidden=8),
                   microbatches=4, microbatch_size=1, dtype="float64")
    cfg = model_config(job)
    return cfg, CaptionBatches(ShapeImages(16, job.seed), cfg, 6, rows, job.seed)


def mllm_reference(cfg, batches, optimizer=sgd) -> dict:
    """The multimodal reference's losses, first gradients and final parameters over
    `batches` (as compare_with_reference's), under the stages' names."""
    from stp.models.mllm.reference import build_mllm_reference

    ref = build_mllm_reference(cfg, torch.float64)
    named = ref.named_full()
    opt = optimizer(list(ref.parameters()))
    out: dict = {"losses": []}
    for step, batch in enumerate(batches):
        opt.zero_grad()
        loss = ref.loss(*batch)
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in named.items()}
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in named.items()}
    return out
