"""Megatron-style tensor-parallel pieces (STP paper arXiv 2510.27257, Fig. 2; Shoeybi et al. 2019,
section 3) written so that no collective hides inside autograd.

- Column-parallel linear: W [out, in] split on out (dim 0); the input is
  replicated, the output sharded. Its input gradient is a partial sum: the
  caller all-reduces it.
- Row-parallel linear: W split on in (dim 1); the input is sharded, the output
  a partial sum: the caller all-reduces it.
Locally both are y = x W_local^T, so one autograd Function serves both; what
differs is only where the caller puts the all-reduce (at a unit boundary).

The Function splits the backward (Zero Bubble, arXiv 2401.10241, section 2): its
backward computes dx = dy W only and appends (W, x, dy) to a sink; the W pass
computes dW += dy^T x from it later (stp.models.tp.wgrad).

Vocab-parallel embedding and cross-entropy shard the vocabulary: rank t owns
token ids [t V'/tp, (t+1) V'/tp), V' the vocabulary padded to a multiple of tp
(the padding columns are masked out of the loss). Targets equal to
IGNORE_INDEX (-100) add nothing to the loss and get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stp.models.tp.wgrad import GradTaps, LinearGrad, NormGrad, WGradEntry
from stp.shapes.decoder import IGNORE_INDEX

__all__ = [
    "linear",
    "rms_norm",
    "vocab_embedding_partial",
    "vocab_ce_stats",
    "vocab_ce_finish",
    "vocab_ce_grad",
    "valid_token_ratio",
]


class _LinearFn(torch.autograd.Function):
    """y = x W^T (+ b); backward gives dx only and defers dW (and db) to the sink."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        sink: list[WGradEntry],
        bias: torch.Tensor | None,
    ):
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.bias = sink, bias
        y = x @ weight.t()
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.sink.append(LinearGrad(weight, x, grad_out, ctx.bias))
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    sink: list[WGradEntry] | GradTaps | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T (+ bias [out]) -> [..., out], with the weight
    (and bias) gradients deferred to the sink; sink None: plain F.linear
    (autograd's own weight gradients, for a backward that computes them at once)."""
    if sink is None:
        return F.linear(x, weight, bias)
    if isinstance(sink, GradTaps):
        y = F.linear(x, weight, bias)
        sink.linear(weight, x, y, bias)
        return y
    route = getattr(sink, "route_linear", None)  # stp.models.tp.sequence.RegatheredInput
    if route is not None:
        return route(x, weight, bias)
    return _LinearFn.apply(x, weight, sink, bias)


def _logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.logsumexp(x, dim) for finite maxima, the same sum in the same order (torch
    also shifts by the max), in half the aten ops: torch's adds an inf guard on the max
    around it. A max of +-inf gives NaN or +-inf here as there."""
    m = x.amax(dim, keepdim=True)
    return (x - m).exp().sum(dim).log() + m.squeeze(dim)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Norm statistics and softmax in at least float32 (bf16 / fp16 lose the mean square).
    return torch.promote_types(dtype, torch.float32)


class _RMSNormFn(torch.autograd.Function):
    """y = g * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps) (Zhang and Sennrich 2019).
    Backward: dx = rstd * (dxhat - xhat * mean(dxhat * xhat)), dxhat = dy * g; the
    gain's gradient sum(dy * xhat) is deferred to W."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, sink: list[WGradEntry]
    ):
        xf = x.to(_compute_dtype(x.dtype))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.sink = sink
        return (xhat * weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors
        ctx.sink.append(NormGrad(weight, xhat, grad_out))
        dxhat = grad_out.to(xhat.dtype) * weight
        grad_x = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        return grad_x.to(grad_out.dtype), None, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float,
    sink: list[WGradEntry] | GradTaps | None,
) -> torch.Tensor:
    """RMSNorm over the last dim with the gain's gradient deferred to W; sink None:
    the same maths in plain autograd ops. The deferred form stays a Function even
    with GradTaps: it keeps only xhat and rstd for B (plain ops would keep x as
    well, which the caller may overwrite once the forward returns)."""
    if sink is None:
        xf = x.to(_compute_dtype(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)
    return _RMSNormFn.apply(x, weight, eps, sink.sink if isinstance(sink, GradTaps) else sink)


def vocab_embedding_partial(
    ids: torch.Tensor, weight: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's share of the embedding lookup: rows for the ids it owns, zeros for
    the others, so the sum over TP ranks (one all-reduce) is the full lookup.
    Returns (partial [b, s, h], owned mask [b, s], local row of each id [b, s])."""
    local = ids - vocab_start
    owned = (local >= 0) & (local < weight.shape[0])
    local = torch.where(owned, local, torch.zeros_like(local))
    partial = weight[local] * owned.unsqueeze(-1).to(weight.dtype)
    return partial, owned, local


def _valid_columns(lf: torch.Tensor, vocab_valid: int | None) -> torch.Tensor:
    """Logits with the vocabulary padding columns (index >= vocab_valid) at -inf, so
    they carry no probability and get no gradient."""
    if vocab_valid is None or vocab_valid >= lf.shape[-1]:
        return lf
    return lf.masked_fill(torch.arange(lf.shape[-1], device=lf.device) >= vocab_valid,
                          float("-inf"))


def vocab_ce_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    tp_size: int,
    tp_rank: int,
    vocab_valid: int | None = None,
) -> torch.Tensor:
    """Partial statistics of the vocab-parallel cross-entropy, made to be SUMMED over
    the TP group by one all-reduce: rows 0..tp-1 hold each rank's local
    logsumexp (rank t writes row t, the others are 0), row tp the target's logit
    (only its owner adds it). The global logsumexp is then
    log sum_t exp(lse_t) = m + log sum_t exp(lse_t - m), m = max_t lse_t: the
    max-shift of Megatron's max all-reduce, done after one sum all-reduce
    instead of before a second one. `vocab_valid`: this rank's real columns
    (the rest is vocabulary padding, left out). Returns [tp + 1, b, s] in
    float32 or wider. With one rank (tp_size 1) the row of an ignored target holds
    some logit instead of 0: `vocab_ce_finish` leaves those tokens out either way."""
    lf = _valid_columns(logits.to(_compute_dtype(logits.dtype)), vocab_valid)
    if tp_size == 1:  # every target is this rank's: no ownership masks, no zero rows
        picked = lf.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.stack((_logsumexp(lf, -1), picked))
    stats = lf.new_zeros((tp_size + 1, *targets.shape))
    stats[tp_rank] = _logsumexp(lf, -1)
    local = targets - vocab_start
    owned = (local >= 0) & (local < logits.shape[-1])
    picked = lf.gather(-1, torch.where(owned, local, 0).unsqueeze(-1)).squeeze(-1)
    stats[tp_size] = torch.where(owned, picked, 0.0)
    return stats


def valid_token_ratio(targets: torch.Tensor) -> float:
    """Target positions / valid targets (at least one) of a global batch: the factor
    from the loss units' value (sum over valid tokens / positions) to the mean over
    the valid tokens; exactly 1.0 without ignored targets."""
    if targets.device.type == "cpu" and not targets.requires_grad:
        # read on the host, where the batch is: no aten op, no device sync
        valid = int((targets.numpy() != IGNORE_INDEX).sum())
    else:
        valid = int((targets != IGNORE_INDEX).sum())
    return targets.numel() / max(valid, 1)


def vocab_ce_finish(
    stats: torch.Tensor, targets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the reduced statistics: (loss, global logsumexp [b, s]). The loss is the
    sum of the token losses over the number of positions; a target equal to
    IGNORE_INDEX adds nothing (without any it is the mean over tokens)."""
    # the logsumexp of one rank's row is that row, bit for bit (exp(0) = 1, log(1) = 0);
    # copied: B keeps lse, and a view would keep the target row's storage with it
    lse = stats[0].clone() if stats.shape[0] == 2 else _logsumexp(stats[:-1], 0)
    token_loss = lse - stats[-1]
    if targets is not None:
        token_loss = torch.where(targets != IGNORE_INDEX, token_loss, 0.0)
    return token_loss.mean(), lse


def vocab_ce_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int | None,
    grad_loss: torch.Tensor,
    vocab_valid: int | None = None,
) -> torch.Tensor:
    """d(loss)/d(local logits) * grad_loss = (softmax - onehot) * grad_loss / n for a
    valid target, 0 for an ignored one, with softmax = exp(logits - global lse): no
    collective needed. `vocab_start` None: this rank holds the whole vocabulary (one
    TP rank), so every valid target is its own."""
    lf = _valid_columns(logits.to(_compute_dtype(logits.dtype)), vocab_valid)
    grad = torch.exp(lf - lse.unsqueeze(-1))
    if vocab_start is None:  # an ignored target's row takes the -1 too: zeroed below
        grad.scatter_(-1, targets.clamp(min=0).unsqueeze(-1), -1.0, reduce="add")
    else:
        local = targets - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])
        rows = torch.where(owned, local, 0).unsqueeze(-1)
        grad.scatter_add_(-1, rows, -owned.to(grad.dtype).unsqueeze(-1))
    grad.masked_fill_((targets == IGNORE_INDEX).unsqueeze(-1), 0.0)
    grad.mul_(grad_loss.to(grad.dtype) / targets.numel())
    return grad.to(logits.dtype)
