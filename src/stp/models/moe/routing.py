"""Routing maths of an MoE layer, shared by its unit (stp.models.moe.units).

- `route`: router logits, the softmax over experts in at least float32 (as
  transformers' Qwen2-MoE and Mixtral routers compute it; a float64 model
  computes it in float64), the top-k experts of each token, their weights
  renormalised when `norm_topk_prob`, cast back to the model's dtype.
- `aux_loss`: the load-balancing loss of one layer's tokens, transformers'
  `load_balancing_loss_func` for one layer: E * sum_e f_e * P_e, f_e the share
  of the n*k routing choices that went to expert e (summed over the k slots,
  divided by n), P_e the mean routing probability of expert e; the gradient
  flows through P only (f counts choices).

transformers concatenates every layer's router logits of the whole batch before
it takes f and P, which couples all layers and all microbatches: under pipeline
parallelism a stage's backward of microbatch 0 runs before later microbatches
(and later stages' layers) have routed, so that sum cannot be differentiated
exactly there. stp's objective averages the per-layer, per-microbatch loss
instead (Megatron-LM and Switch Transformer take it per layer too): with one
MoE layer and one microbatch it is transformers' number exactly
(tests/models/test_moe_hf.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["aux_loss", "expert_counts", "route", "softmax_dtype"]


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The router softmax runs in float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in logits' dtype, expert ids [n, k]) of router logits [n, E]."""
    probs = F.softmax(logits, dim=-1, dtype=softmax_dtype(logits.dtype))
    top, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def aux_loss(logits: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The load-balancing loss of one layer's router logits [n, E] and choices [n, k]
    (0-dim, in the softmax dtype; differentiable through the logits)."""
    probs = F.softmax(logits, dim=-1, dtype=softmax_dtype(logits.dtype))
    n = logits.shape[0]
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).to(probs.dtype)
    return num_experts * ((counts / n) * (probs.sum(0) / n)).sum()


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routing choices per expert [E] (int64), for load-balance figures."""
    return torch.bincount(ids.reshape(-1), minlength=num_experts)
