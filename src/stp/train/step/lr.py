"""Learning-rate schedules and AdamW parameter groups, as large-model training runs them.

    lr(step)  warm-up (step < warmup):  base * (step + 1) / warmup
              then, progress p = (step - warmup) / (total_steps - warmup) in [0, 1]:
                constant   base
                linear     min_lr + (base - min_lr) * (1 - p)
                cosine     min_lr + (base - min_lr) * (1 + cos(pi p)) / 2

`step` counts optimizer updates taken (a step skipped for inf/NaN gradients
does not advance it, as Megatron-LM's scheduler). The warm-up starts at
base / warmup rather than 0, so the first update is not wasted.

Weight decay (AdamW, decoupled: Loshchilov and Hutter, arXiv 1711.05101)
applies to matrices only: norm gains and biases (one-dimensional parameters)
are left undecayed, Megatron-LM's default rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["SCHEDULES", "LRSchedule", "make_scheduler", "param_groups", "adamw"]

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """How the learning rate moves from the optimizer's own lr (the base)."""

    kind: str = "constant"
    """constant, cosine or linear (after the warm-up)."""
    total_steps: int = 0
    """Updates over which cosine / linear decay from the base to `min_lr`."""
    warmup: int = 0
    """Updates of linear warm-up at the start."""
    min_lr: float = 0.0
    """Where cosine / linear decay ends (absolute, not a fraction of the base)."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"lr schedule {self.kind!r} not accepted; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.warmup < 0 or self.total_steps < 0:
            raise ValueError(f"warmup ({self.warmup}) and total_steps ({self.total_steps}) "
                             "must be >= 0")
        if not (math.isfinite(self.min_lr) and self.min_lr >= 0):
            raise ValueError(f"min_lr must be a finite number >= 0, got {self.min_lr}")

    def lr(self, step: int, base: float) -> float:
        """The learning rate of update `step` (0-based) for a base of `base`."""
        if step < self.warmup:
            return base * (step + 1) / self.warmup
        if self.kind == "constant":
            return base
        span = max(1, self.total_steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (base - self.min_lr) * shape


def make_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR giving every param group `schedule.lr(step, its base lr)`.

    The factor is a closure, not a callable object, so the scheduler's state
    dict holds only its counters and base rates: a resumed run keeps the
    schedule it was started with on the command line, and the position and
    base rates of the checkpoint."""
    for group in optimizer.param_groups:
        base = group.get("initial_lr", group["lr"])
        if schedule.kind != "constant" and schedule.min_lr > base:
            raise ValueError(f"min_lr {schedule.min_lr:g} is above the learning rate {base:g}; "
                             "give a min_lr <= lr")

    def factor_of(base: float) -> Callable[[int], float]:
        def factor(step: int) -> float:
            return schedule.lr(step, base) / base if base > 0 else 0.0

        return factor

    bases = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor_of(b) for b in bases])


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices with `weight_decay`, one-dimensional parameters
    (norm gains, biases) without. Empty groups are left out."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


FUSED_DEVICES = ("cpu", "cuda")
"""Where torch's fused AdamW runs (`_fused_adamw_`)."""


def fusable(params: Iterable[torch.Tensor]) -> bool | None:
    """True when torch's fused AdamW can step every one of `params`: one kernel call
    over all of them instead of about fifteen small ops and a read of the step count
    per parameter (the for-each loop torch picks on the CPU); None (torch's choice)
    otherwise."""
    ps = list(params)
    ok = bool(ps) and all(p.device.type in FUSED_DEVICES and p.is_floating_point()
                          for p in ps)
    return True if ok else None


def _contiguous_grads(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Make every gradient contiguous before a fused step: torch's fused CPU AdamW
    (torch 2.13) reads a gradient's memory in order, ignoring its strides, so a
    transposed one gives a wrong update. stp's gradients are contiguous (checked
    once per tensor here, a few dozen calls a step); a user's stage may not be."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()


def adamw(
    lr: float, *, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory for `Trainer`: AdamW over `param_groups` (no decay
    on norms and biases)."""
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        fused = fusable(params)
        opt = torch.optim.AdamW(param_groups(params, weight_decay), lr=lr, betas=betas,
                                eps=eps, fused=fused)
        if fused:
            opt.register_step_pre_hook(_contiguous_grads)
        return opt

    return make
