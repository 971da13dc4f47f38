"""stp.models.moe.routing against hand counts and transformers' load-balancing loss.

Written to kill mutants mutmut left alive in stp/models/moe/routing.py
(docs/testing.md): the model-level tests compare whole MoE models in float64,
where the router's softmax precision and a single routing weight hardly show.
Each test names the bug it guards against.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from stp.models.moe.routing import aux_loss, expert_counts, route, softmax_dtype


def _logits(*probs: float) -> torch.Tensor:
    """Router logits of one token whose softmax is `probs` (log-probabilities)."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def test_top_k_weights_and_ids_by_hand() -> None:
    """Kills: the softmax over the wrong dimension, top-k of the logits' wrong end,
    the renormalisation skipped, inverted or summed over the wrong axis."""
    logits = torch.cat([_logits(0.1, 0.2, 0.3, 0.4), _logits(0.5, 0.25, 0.15, 0.1)])
    weights, ids = route(logits, 2, norm_topk_prob=False)
    assert ids.tolist() == [[3, 2], [0, 1]]
    assert torch.allclose(weights, torch.tensor([[0.4, 0.3], [0.5, 0.25]], dtype=torch.float64))
    weights, ids = route(logits, 2, norm_topk_prob=True)
    assert ids.tolist() == [[3, 2], [0, 1]]
    assert torch.allclose(weights, torch.tensor([[4 / 7, 3 / 7], [2 / 3, 1 / 3]],
                                                dtype=torch.float64))


def test_bf16_routing_is_a_float32_router_cast_to_bf16() -> None:
    """Kills: the softmax taken in bf16 (softmax_dtype returning the model's dtype) and
    the weights left in float32. Reference: transformers' routers, a float32 softmax,
    top-k and renormalisation, cast to bf16 at the end."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 8, generator=gen) * 3).to(torch.bfloat16)
    for norm in (False, True):
        probs = torch.softmax(logits.float(), dim=-1)
        top, ref_ids = torch.topk(probs, 2, dim=-1)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        weights, ids = route(logits, 2, norm_topk_prob=norm)
        assert weights.dtype == torch.bfloat16
        assert torch.equal(ids, ref_ids)
        assert torch.equal(weights, top.to(torch.bfloat16))


def test_softmax_dtype_is_float32_or_float64() -> None:
    """Kills: a softmax dtype other than promote(dtype, float32)."""
    assert softmax_dtype(torch.bfloat16) == torch.float32
    assert softmax_dtype(torch.float16) == torch.float32
    assert softmax_dtype(torch.float32) == torch.float32
    assert softmax_dtype(torch.float64) == torch.float64


def test_aux_loss_is_transformers_load_balancing_loss_of_one_layer() -> None:
    """Kills: f or P divided by the wrong count, E missing, counts summed per slot,
    the softmax over tokens. Reference: transformers' load_balancing_loss_func."""
    gen = torch.Generator().manual_seed(1)
    experts, k = 4, 2
    logits = torch.randn(6, experts, generator=gen, dtype=torch.float64)
    _, ids = route(logits, k, norm_topk_prob=True)
    ours = aux_loss(logits, ids, experts)
    theirs = load_balancing_loss_func((logits,), experts, k)
    # transformers takes its softmax in float32 whatever the logits' dtype
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_aux_loss_by_hand_with_an_unchosen_expert() -> None:
    """Kills: bincount without minlength (an expert nobody chose, last), and the
    loss not scaled by E. Two tokens, three experts, k = 1: both choose expert 0;
    f = (1, 0, 0), P = mean of the softmaxes."""
    logits = torch.cat([_logits(0.5, 0.3, 0.2), _logits(0.7, 0.2, 0.1)])
    ids = torch.tensor([[0], [0]])
    assert aux_loss(logits, ids, 3).item() == pytest.approx(3 * 1.0 * (0.5 + 0.7) / 2, rel=1e-12)
    assert expert_counts(torch.tensor([[0, 1], [0, 1]]), 3).tolist() == [2, 2, 0]


def test_aux_loss_of_bf16_logits_is_taken_in_float32() -> None:
    """Kills: the aux-loss softmax without its float32 dtype (taken in bf16). Reference:
    the same loss of the logits cast to float32 (exact in float32: bf16 -> fp32 is)."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(32, 4, generator=gen) * 2).to(torch.bfloat16)
    _, ids = route(logits, 2, norm_topk_prob=True)
    ours = aux_loss(logits, ids, 4)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, aux_loss(logits.float(), ids, 4))


def test_aux_loss_shares_in_float64_for_a_float64_model() -> None:
    """Kills: the choice counts left as integers (their share then divided in the
    default float32). Three tokens, k = 1, choices (0, 0, 1): f = (2/3, 1/3, 0), which
    float32 rounds at 1e-8."""
    logits = torch.cat([_logits(0.5, 0.3, 0.2), _logits(0.6, 0.3, 0.1), _logits(0.2, 0.7, 0.1)])
    ids = torch.tensor([[0], [0], [1]])
    p0, p1 = (0.5 + 0.6 + 0.2) / 3, (0.3 + 0.3 + 0.7) / 3
    assert aux_loss(logits, ids, 3).item() == pytest.approx(3 * (2 / 3 * p0 + 1 / 3 * p1),
                                                            rel=1e-14)
