"""Shared by the parity tests: run a Trainer for two steps and compare with the
single-process reference on the same model, data and optimizer."""

from __future__ import annotations

import torch

from stp.models import ModelConfig, build_reference


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
