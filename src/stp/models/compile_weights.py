"""The weight side of the compiled pieces' backward (stp.models.compile_pieces):
with a sink, W's records exactly as the eager taps or deferring Functions make
them (Zero Bubble's deferred W, arXiv 2401.10241); without one (a full BW in
plain autograd), the weight gradients themselves. And what a norm keeps beyond
its statistics, so the compiled pieces keep eager's bytes."""

from __future__ import annotations

from typing import Any

import torch

from stp.models.tp.wgrad import GradTaps, LinearGrad, NormGrad, WGradEntry

__all__ = ["entries", "fusable", "norm_kept_input", "norm_weight_work", "weight_work"]


def norm_kept_input(x: torch.Tensor, sink: list[WGradEntry] | None) -> tuple[torch.Tensor, ...]:
    """What a norm keeps beyond xhat and rstd: in a plain-autograd full BW (no sink) the
    eager ops keep the input in the statistics' dtype (x itself in float32 and
    float64), so the compiled pieces keep it too and the bytes stay eager's."""
    if sink is not None:
        return ()
    return (x.detach().to(torch.promote_types(x.dtype, torch.float32)),)


def norm_weight_work(sink: list[WGradEntry] | None, need: bool, g: torch.Tensor,
                     xhat: torch.Tensor, dh: torch.Tensor) -> torch.Tensor | None:
    """The gain's side of a norm's B: W's record with a sink, else its gradient."""
    if sink is not None:
        sink.append(NormGrad(g, xhat, dh))
        return None
    if not need:
        return None
    return (dh.to(xhat.dtype) * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(g.dtype)


def weight_work(sink: list[WGradEntry] | None, needs: tuple[bool, ...],
                 linears: tuple[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                      torch.Tensor], ...]) -> tuple[torch.Tensor | None, ...]:
    """The weight side of a fused piece's B, per linear (weight, bias, input x, output
    gradient dy): with a sink, W's records (LinearGrad, exactly what the taps or the
    deferring Functions record), and no gradient returned; without one (a full BW in
    plain autograd), the gradients themselves, weights then biases, as the
    Function's backward returns them (`needs`: ctx.needs_input_grad of those)."""
    if sink is not None:
        sink.extend(LinearGrad(w, x, dy, bias) for w, bias, x, dy in linears)
        return (None,) * (2 * len(linears))
    grads: list[torch.Tensor | None] = []
    for w, _, x, dy in linears:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        grads.append((dy2.t() @ x2).to(w.dtype))
    for _, bias, _, dy in linears:
        grads.append(None if bias is None else dy.reshape(-1, dy.shape[-1]).sum(0))
    return tuple(g if need else None for g, need in zip(grads, needs, strict=True))


def entries(sink: list[WGradEntry] | GradTaps | None) -> list[WGradEntry] | None:
    return sink.sink if isinstance(sink, GradTaps) else sink


def fusable(sink: Any) -> bool:
    """A sink a fused piece can serve: taps, a list, or none (plain autograd). Sequence
    parallelism's RegatheredInput routes each linear itself: the pieces one by one."""
    return sink is None or isinstance(sink, (GradTaps, list))
