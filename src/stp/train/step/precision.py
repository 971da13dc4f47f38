"""Mixed precision as Megatron-LM runs it, and the optimizer update around it.

bf16 (or fp16) model, as "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (Narayanan et al., arXiv 2104.04473) trains:

    model weights     bf16, what the forward and backward compute with
    main grads        fp32, one buffer per parameter; every microbatch's weight
                      gradient is added to it as soon as its W produces it, so
                      the sum over microbatches is never rounded to bf16
    master weights    fp32 copy of every parameter; the optimizer steps these
                      (its state is fp32 too), reading the main grads
    after the step    masters rounded back into the bf16 model

An update of 2e-5 on a weight of 0.02 is below half a bf16 ulp (1.2e-4) and
vanishes when bf16 weights are stepped directly; on the fp32 master it
accumulates until it moves the bf16 copy.

float32 and float64 models are pure: the optimizer steps the model's own
parameters with their `.grad`; nothing is copied.

The fold into the main grad happens after each unit's W (and after a unit's
backward_finish, which adds the RMSNorm gain's gradient when W ran early in a
braided block), by wrapping those two methods of every unit that holds
parameters; whatever a stage accumulates otherwise is folded once the step's
backward has run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stp.train.step.clip import clip_coefficient, scale_grads

__all__ = ["LOW_PRECISION", "Precision", "UpdateStats", "apply_update"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _held_ids(unit: Any) -> list[int]:
    """ids of the tensors a unit holds: its attributes, and `weights()` (a unit that
    runs several layers, stp.models.decoder.chunk, holds them through its parts)."""
    held = [*vars(unit).values(), *(unit.weights() if callable(getattr(unit, "weights", None))
                                    else ())]
    return list(dict.fromkeys(id(v) for v in held))


class Precision:
    """The parameters the optimizer steps and their gradients, for one rank.

    `named`: this rank's (global name, model parameter); `units`: objects whose
    `weight` / `backward_finish` produce weight gradients (stp.models units)."""

    def __init__(
        self, named: Sequence[tuple[str, nn.Parameter]], units: Iterable[Any] = ()
    ) -> None:
        self.names = [n for n, _ in named]
        self.model = [p for _, p in named]
        self.mixed = any(p.dtype in LOW_PRECISION for p in self.model)
        self.params: list[nn.Parameter] = self._optimizer_params()
        """What the optimizer steps: fp32 masters (mixed) or the model's parameters
        (stp.train.step.zero: this rank's shards of them)."""
        if not self.mixed:
            return
        index = {id(p): i for i, p in enumerate(self.model)}
        for unit in units:
            mine = [index[i] for i in _held_ids(unit) if i in index]
            if mine:
                for method in ("weight", "backward_finish"):
                    if callable(getattr(unit, method, None)):
                        setattr(unit, method, self._folding(getattr(unit, method), mine))

    def _optimizer_params(self) -> list[nn.Parameter]:
        """fp32 masters whose `.grad` is the main grad (mixed), else the model's own."""
        if not self.mixed:
            return self.model
        masters = [nn.Parameter(p.detach().float().clone()) for p in self.model]
        for master in masters:
            master.grad = torch.zeros_like(master)  # the main grad
        return masters

    def _main_grad(self, i: int) -> torch.Tensor:
        """The fp32 buffer parameter i's weight gradients are summed into (mixed)."""
        return self.params[i].grad  # type: ignore[return-value]  # a master's .grad is its fp32 buffer, set up front

    @torch.no_grad()
    def group_main_grads(self, groups: Iterable[Sequence[int]]) -> list[torch.Tensor]:
        """Move the main grads of each group of parameters (mixed) into one flat fp32
        buffer of the group's own, each main grad a view of it in the group's order,
        and return the buffers: a DP reduction of a group's gradients then reduces its
        buffer in place, with no flat copy beside the gradients (stp.train.step.grad_sync;
        Megatron-LM's contiguous gradient buffer). Nothing to group when pure: the
        model's own `.grad` is what autograd and the units create."""
        if not self.mixed:
            return []
        buffers = []
        for group in groups:
            masters = [self.params[i] for i in group]
            flat = torch.empty(sum(m.numel() for m in masters), dtype=torch.float32,
                               device=masters[0].device)
            offset = 0
            for m in masters:
                view = flat[offset : offset + m.numel()].view_as(m)
                view.copy_(m.grad)  # type: ignore[arg-type]  # the masters' .grad are set up front
                m.grad, offset = view, offset + m.numel()
            buffers.append(flat)
        return buffers

    def _folding(self, inner: Callable[..., Any], indices: list[int]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            out = inner(*args, **kw)
            self._fold(indices)
            return out

        return run

    def _fold(self, indices: Iterable[int]) -> None:
        """main grad += model .grad (in fp32); the model's .grad is dropped. One
        multi-tensor add for all of them (the same adds, fewer calls)."""
        mains, grads = [], []
        for i in indices:
            p = self.model[i]
            if p.grad is not None:
                mains.append(self._main_grad(i))
                grads.append(p.grad)
                p.grad = None
        if mains:
            torch._foreach_add_(mains, grads)

    def fold(self, indices: Iterable[int] | None = None) -> None:
        """Fold what is left in the model's `.grad` (call after the backward; `indices`:
        of those parameters only, e.g. a stage's once its gradients are final)."""
        if self.mixed:
            self._fold(range(len(self.model)) if indices is None else indices)

    def zero_grad(self) -> None:
        """Zero the main grads (mixed; the model's own `.grad` the stages zero)."""
        if self.mixed:
            torch._foreach_zero_([self._main_grad(i) for i in range(len(self.model))])

    def grads(self) -> list[torch.Tensor]:
        """The gradient of each parameter in `params` (created as zeros if missing)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]  # type: ignore[misc]  # the masters' .grad are set up front

    def full_grads(self, indices: Iterable[int] | None = None) -> list[torch.Tensor]:
        """The whole gradient of each model parameter (its main grad when mixed), in
        the order of `names` (`indices`: of those only): what the shared-gradient sum
        adds up. The same tensors as `grads()` here; stp.train.step.zero's are the
        model's, not the shards' (copies where its main grads are packed)."""
        grads = self.grads()
        return grads if indices is None else [grads[i] for i in indices]

    def grad_buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the gradients (what `stp train --json` counts)."""
        return self.full_grads()

    def norm_keys(self, keys: list[Any]) -> list[Any]:
        """What identifies each of `grads()` in the global norm (stp.train.step.clip), from the
        keys of the model's parameters (stp.train.checkpoint.shards.norm_key): the same here."""
        return keys

    def optimizer_box(self, i: int, box: Any) -> Any:
        """The box of the full-model tensor `params[i]` covers, from `box`, model
        parameter i's (stp.train.checkpoint.shards.Box): the same here."""
        return box

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the masters into the model (mixed; nothing to do when pure)."""
        if self.mixed:
            torch._foreach_copy_(self.model, self.params)  # type: ignore[arg-type]  # list[Parameter] is a list of Tensors; the stub's list is invariant


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer update did."""

    grad_norm: float
    """Global gradient norm before clipping (stp.train.step.clip)."""
    lr: float
    """Learning rate of the first param group for this update."""
    skipped: bool
    """The gradients held inf or NaN: no rank updated anything."""


def apply_update(
    precision: Precision, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, norm: float,
    max_norm: float | None, copy_to_model: Callable[[], None] | None = None,
) -> UpdateStats:
    """Clip by the global `norm` (when `max_norm`), step the optimizer and the
    schedule, copy the masters back (`copy_to_model`: what does instead of
    `precision.copy_to_model`, e.g. launches the sharded optimizer's overlapped
    all-gathers, stp.train.step.param_gather). A non-finite norm skips all of it;
    `norm` is the same on every rank, so every rank decides alike."""
    lr = float(optimizer.param_groups[0]["lr"])
    if not math.isfinite(norm):
        return UpdateStats(norm, lr, skipped=True)
    if max_norm is not None:
        scale_grads(precision.grads(), clip_coefficient(norm, max_norm))
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    (copy_to_model or precision.copy_to_model)()
    return UpdateStats(norm, lr, skipped=False)
