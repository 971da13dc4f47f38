"""The deferred weight-gradient store of the split backward (Zero Bubble, arXiv 2401.10241,
section 2): B computes input gradients only and records, per parameter, what W
needs; W later turns the records into `.grad` and frees them.

    linear  y = x W^T + b  B: dx = dy W            W: dW += dy^T x, db += sum dy
    RMSNorm y = xhat * g   B: dx (needs g, xhat)   W: dg += sum_tokens dy * xhat
    embed   y = E[ids]     B: (no input grad)      W: dE[ids] += dy

The RMSNorm weights are small, but they are still deferred to W so that B never
touches `.grad` (the PipelineStage contract: weight gradients wait for W).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["LinearGrad", "NormGrad", "EmbedGrad", "ReadyGrad", "WGradEntry", "WGradStore",
           "GradTaps", "accumulate_grad"]


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, creating it on first use (gradients accumulate over
    microbatches until the optimizer zeroes them)."""
    if grad.dtype != param.dtype:  # checked here: a no-op .to() is still a dispatch
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.contiguous()
    else:
        param.grad.add_(grad)


@dataclass
class LinearGrad:
    weight: torch.Tensor
    """[out, in] local shard."""
    x: torch.Tensor
    """Input [..., in] saved by the forward."""
    grad_out: torch.Tensor
    """Output gradient [..., out] from B."""
    bias: torch.Tensor | None = None
    """[out] local shard of the bias, if the linear has one: db += sum_tokens dy."""

    def accumulate(self) -> None:
        if self.bias is not None:
            dy = self.grad_out.detach()
            accumulate_grad(self.bias, dy.reshape(-1, dy.shape[-1]).sum(0))
        # detached: x requires grad (it is the autograd input h_in), and a .grad
        # with a graph would keep every microbatch's x and dy alive until zero_grad
        x2 = self.x.detach().reshape(-1, self.x.shape[-1])
        gy2 = self.grad_out.detach().reshape(-1, self.grad_out.shape[-1])
        dtype = self.weight.dtype
        if self.weight.grad is None:
            dw = gy2.t() @ x2
            self.weight.grad = dw if dw.dtype == dtype else dw.to(dtype)
        elif gy2.dtype == dtype and x2.dtype == dtype:
            self.weight.grad.addmm_(gy2.t(), x2)
        else:
            self.weight.grad.addmm_(gy2.t().to(dtype), x2.to(dtype))


@dataclass
class NormGrad:
    weight: torch.Tensor
    """[h] RMSNorm gain (replicated over TP)."""
    xhat: torch.Tensor
    """Normalised input x * rstd [..., h]."""
    grad_out: torch.Tensor
    """Output gradient [..., h] (already all-reduced over TP, so replicated)."""

    def accumulate(self) -> None:
        h = self.xhat.shape[-1]
        accumulate_grad(self.weight, (self.grad_out * self.xhat).reshape(-1, h).sum(0))


@dataclass
class EmbedGrad:
    weight: torch.Tensor
    """[V / tp, h] local vocab shard."""
    local_ids: torch.Tensor
    """Row of each token in the local shard [n] (only tokens this rank owns)."""
    grad_out: torch.Tensor
    """Output gradient of those tokens [n, h]."""

    def accumulate(self) -> None:
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        self.weight.grad.index_add_(0, self.local_ids, self.grad_out.to(self.weight.dtype))


@dataclass
class ReadyGrad:
    weight: torch.Tensor
    grad: torch.Tensor
    """A gradient autograd already computed in B (a backward whose W follows at once,
    stp.models.decoder.units); W only adds it."""

    def accumulate(self) -> None:
        accumulate_grad(self.weight, self.grad)


WGradEntry = LinearGrad | NormGrad | EmbedGrad | ReadyGrad


class GradTaps:
    """Linear layers' weight gradients deferred without an autograd Function of our
    own. The forward runs plain F.linear and notes each output's place in the graph
    (a GradientEdge: the node and output index, not the tensor, so no activation is
    kept for it); B asks the engine for the input gradient and for the gradients
    at those places in the same walk, and `caught` turns them into W work in
    `sink`, as the Function's backward would. Autograd computes no weight
    gradient (none is asked for), and the walk runs no Python: a Function costs a
    Python forward and a Python backward per linear, a hook a Python call (and a
    hook's closure on the graph must be freed with the interpreter's lock, which a
    communication thread may not get at exit)."""

    __slots__ = ("sink", "_taps")

    def __init__(self, sink: list[WGradEntry]) -> None:
        self.sink = sink
        self._taps: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def linear(self, weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               bias: torch.Tensor | None) -> None:
        self._taps.append((get_gradient_edge(y), weight, x, bias))

    def edges(self) -> tuple[Any, ...]:
        return tuple(t[0] for t in self._taps)

    def caught(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The output gradients at `edges()`, in order, from B's graph walk."""
        for (_, weight, x, bias), g in zip(self._taps, grads, strict=True):
            if g is not None:
                self.sink.append(LinearGrad(weight, x, g, bias))
        self._taps.clear()


class WGradStore:
    """Per-microbatch lists of pending W work for one unit.

    `open(mb)` at forward time gives the list the unit's autograd Functions append
    to during B; `flush(mb)` runs W for that microbatch and drops the tensors."""

    def __init__(self) -> None:
        self._pending: dict[int, list[WGradEntry]] = {}

    def open(self, mb: int) -> list[WGradEntry]:
        if mb in self._pending:
            raise RuntimeError(f"microbatch {mb} already has weight-gradient work pending")
        sink: list[WGradEntry] = []
        self._pending[mb] = sink
        return sink

    def flush(self, mb: int) -> None:
        sink = self._pending.pop(mb)
        for entry in sink:
            entry.accumulate()
        sink.clear()

    def discard(self, mb: int) -> None:
        self._pending.pop(mb, None)

    def pending(self) -> list[int]:
        return sorted(self._pending)

    def tensors(self, mb: int) -> list[torch.Tensor]:
        """The tensors mb's pending W work holds (for memory accounting and offload)."""
        return [
            t for entry in self._pending.get(mb, ())
            for t in vars(entry).values() if isinstance(t, torch.Tensor)
        ]
