"""An attention unit's body as one compiled graph each way (stp.models.compile), for
the units a stage runs apart (more than one TP rank, or layers not fused): the
q, k, v projections, their rotation, the CPU flash attention kernel and the
output projection, from the normalised input h to the unit's partial sum.

The norm before it and the TP all-reduce after it stay outside (braiding launches
the all-reduce between units). B's graph returns dh and each projection's output
gradient; the Function hands (x, dy) of the four matrices to the unit's
deferred-W sink, or, without a sink (a plain-autograd full BW), returns their
gradients. It saves what the eager ops save: h, the rotary tables, the flash
kernel's q, k, v, output and log-sum-exp, and the output projection's input."""

from __future__ import annotations

from typing import Any

import torch

from stp.models.compile_pieces import (
    qkv_rope_backward,
    qkv_rope_forward,
)
from stp.models.compile_weights import weight_work
from stp.models.tp.wgrad import WGradEntry

_ATEN = torch.ops.aten


def attention_forward(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                      wo: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None,
                      bv: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      head_dim: int) -> tuple[torch.Tensor, ...]:
    """(out, and for B q, k, v, o, lse, o2: the output projection's input)."""
    q, k, v = qkv_rope_forward(h, wq, wk, wv, bq, bk, bv, cos, sin, head_dim)
    o, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    b, _, s, _ = o.shape
    o2 = o.transpose(1, 2).reshape(b, s, -1)
    return o2 @ wo.t(), q, k, v, o, lse, o2


def attention_backward(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                       wv: torch.Tensor, wo: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dh, and the output gradients of the q, k, v projections)."""
    b, s, _ = dy.shape
    do = (dy @ wo).view(b, s, q.shape[1], -1).transpose(1, 2)
    dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True)
    return qkv_rope_backward(dq, dk, dv, wq, wk, wv, cos, sin)


class AttentionFn(torch.autograd.Function):
    """h -> the attention unit's partial sum as one node (the module doc)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                wo: torch.Tensor, bq: torch.Tensor | None, bk: torch.Tensor | None,
                bv: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                sink: list[WGradEntry] | None, kernels: Any):
        # not detached: a Function's forward runs without grad already
        out, q, k, v, o, lse, o2 = kernels.attention_forward(h, wq, wk, wv, wo, bq, bk, bv, cos,
                                                             sin, head_dim)
        ctx.save_for_backward(h, q, k, v, o, lse, o2, wq, wk, wv, wo, cos, sin)
        ctx.biases, ctx.sink, ctx.kernels = (bq, bk, bv), sink, kernels
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        h, q, k, v, o, lse, o2, wq, wk, wv, wo, cos, sin = ctx.saved_tensors
        dh, *dys = ctx.kernels.attention_backward(dy, q, k, v, o, lse, wq, wk, wv, wo, cos, sin)
        bq, bk, bv = ctx.biases
        needs = ctx.needs_input_grad
        grads = weight_work(ctx.sink, (*needs[1:5], *needs[5:8], False),
                            ((wq, bq, h, dys[0]), (wk, bk, h, dys[1]), (wv, bv, h, dys[2]),
                             (wo, None, o2, dy)))
        # weight_work gives weights then biases: wq, wk, wv, wo, bq, bk, bv, (wo's none)
        return dh, *grads[:7], None, None, None, None, None
