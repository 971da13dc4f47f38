"""Activation recomputation in the runtime's units (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198, section 5).

    none       a unit's forward keeps what its backward reads (stp.models.decoder.units)
    selective  the attention core -- RoPE'd q, k, v -> attention output -- keeps only
               its inputs; B runs the core's forward again, then its backward
               (`attention_core`). With a fused (flash) kernel, which
               F.scaled_dot_product_attention is on the CPU too, the core keeps
               no s x s scores anyway: selective saves the kernel's
               log-sum-exp, [b, heads, s] in float32 per attention unit (its
               output is the input the output projection keeps anyway).
    full       a residual unit's forward keeps only its input (this rank's rows under
               sequence parallelism) and runs without an autograd graph; B first
               runs the forward again with the graph (norm, all-gather, body, with
               the weight-gradient taps, so W still gets (x, dy) for every matrix),
               then walks it as it would have. The loss unit does the same (its
               logits, [b, s, V / tp], are the largest tensor a stage keeps).

Every mode computes the same maths: the recomputed forward runs the same
functions on the same values as the forward it replaces, so losses and
gradients are bit for bit those of `none` (checked in float64 by
tests/runtime/test_recompute_runtime.py).

The selective core is an autograd Function of stp's own rather than
torch.utils.checkpoint: a checkpoint hides its saved tensors behind
saved-tensor hooks whose unpacking recomputes, so the activation offloader,
which reads every graph node's saved tensors to count and move them
(stp.runtime.offload), would trigger recomputation in the forward. The
Function's saved tensors are plain `ctx.saved_tensors`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stp.costmodel.decoder.spec import RECOMPUTE_MODES

__all__ = ["RECOMPUTE_MODES", "attention_core", "check_recompute"]


def check_recompute(mode: Any) -> str:
    """`mode` when it is one of RECOMPUTE_MODES; ValueError (one line) otherwise."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          gqa: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    if mask is not None:  # document masking: the mask holds the causal rule too
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


class _RecomputedCore(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v keeping q, k, v only; backward recomputes it."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                gqa: bool, mask: torch.Tensor | None):
        ctx.save_for_backward(q, k, v)
        ctx.flags = (causal, gqa, mask)  # the mask is the step's, shared by every layer
        return _sdpa(q, k, v, causal, gqa, mask)

    @staticmethod
    def backward(ctx: Any, grad_o: torch.Tensor):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            ins = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
            o = _sdpa(*ins, *ctx.flags)
        grads = torch.autograd.grad(o, ins, grad_o)
        return (*grads, None, None, None)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   gqa: bool = False, recompute: str = "none",
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention [b, heads, s, head_dim] (`gqa`: fewer kv heads
    than query heads, grouped-query attention); with recompute "selective" its
    internals are recomputed in B (the module doc). `mask` [b, 1, s, s] bool: where
    a query may attend (document masking, stp.models.documents), in place of the
    causal rule."""
    if recompute == "selective" and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        return _RecomputedCore.apply(q, k, v, causal, gqa, mask)
    return _sdpa(q, k, v, causal, gqa, mask)
