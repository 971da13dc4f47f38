"""MoE routing in bfloat16 against references whose router softmax runs in float32.

transformers' Qwen2-MoE and Mixtral routers take the softmax over the experts in
float32 from the model's (bf16) router logits, pick the top-k there and
(Qwen2-MoE) cast the weights back to bf16. stp does the same
(stp.models.moe.routing). The float64 parity tests (test_moe_hf.py) cannot see
the softmax's precision, and the other bf16 tests compare stp with stp; here:

- `route` on bf16 logits against a float32 router written here, to the bit;
- `aux_loss` against transformers' `load_balancing_loss_func` on the same logits
  in float32;
- stp's MoE unit (the one the stages run) against transformers' own
  Qwen2-MoE and Mixtral sparse blocks in bf16, same weights, same input.

Small router weights (routers start near zero) give logits within a few bf16
ulps of each other, where a bf16 softmax rounds distinct probabilities to ties
and picks other experts: every test below checks first that its input is such a
case (a bf16 router computed here disagrees with the float32 one), so it fails
when stp's softmax runs in bf16.
"""

from __future__ import annotations

import _hf_moe
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeRMSNorm,
    Qwen2MoeSparseMoeBlock,
    load_balancing_loss_func,
)

from stp.models.moe.routing import aux_loss, route
from stp.models.moe.units import MoEUnit

BF16 = torch.bfloat16
TOKENS, EXPERTS, TOP_K = 256, 8, 2


def _float32_router(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """transformers' router: softmax and top-k in float32, weights cast to the logits'
    dtype (Qwen2MoeTopKRouter)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def _bf16_router_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The experts a router taking its softmax in bf16 would pick (the bug)."""
    return torch.topk(torch.softmax(logits, dim=-1), k, dim=-1).indices


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens whose sets of chosen experts differ."""
    return int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())


def _near_tie_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, 32, generator=g).to(BF16)
    router = (0.01 * torch.randn(EXPERTS, 32, generator=g)).to(BF16)
    return F.linear(x, router)


@pytest.mark.parametrize("norm", [False, True], ids=["qwen2-moe", "renormalised"])
def test_route_in_bf16_is_a_float32_router_cast_to_bf16(norm: bool) -> None:
    """Guards against the router softmax computed in bf16 (softmax_dtype returning the
    model's dtype, or F.softmax without its dtype): other experts chosen for the
    near-tied tokens, and renormalised weights rounded twice."""
    logits = _near_tie_logits(0)
    want_w, want_ids = _float32_router(logits, TOP_K, norm)
    assert _differ(_bf16_router_ids(logits, TOP_K), want_ids) > 0  # precision matters here
    weights, ids = route(logits, TOP_K, norm)
    assert weights.dtype == BF16
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_w)


def test_aux_loss_in_bf16_is_transformers_loss_on_float32_logits() -> None:
    """Guards against the load-balancing loss's softmax in bf16: stp's loss of one
    layer is transformers' `load_balancing_loss_func` of that layer's logits taken
    in float32 (the counts from the float32 router's choices), in float32."""
    logits = _near_tie_logits(1)
    _, ids = route(logits, TOP_K, False)
    got = aux_loss(logits, ids, EXPERTS)
    want = load_balancing_loss_func((logits.float(),), EXPERTS, TOP_K)
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()


def _qwen2_block(norm: bool) -> tuple[nn.Module, MoEUnit]:
    cfg = _hf_moe.qwen2_moe_config(num_experts=EXPERTS, norm_topk_prob=norm)
    cfg._experts_implementation = "eager"  # the loop over experts, as a standalone block
    block = Qwen2MoeSparseMoeBlock(cfg)
    return block, _unit_of(block, cfg.moe_intermediate_size, norm, cfg.rms_norm_eps)


def _mixtral_block() -> tuple[nn.Module, MoEUnit]:
    cfg = _hf_moe.mixtral_config(num_local_experts=EXPERTS)
    cfg._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(cfg)
    return block, _unit_of(block, cfg.intermediate_size, True, cfg.rms_norm_eps)


def _unit_of(block: nn.Module, width: int, norm: bool, eps: float) -> MoEUnit:
    """stp's MoE unit with `block`'s weights (drawn here with visible scales, the
    router's small), both in bf16; the unit's RMSNorm gain is ones, so its normed
    input is the bits transformers' RMSNorm gives."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.01 if name == "gate.weight" else 0.2))
    block.to(BF16).eval()
    hidden = block.gate.weight.shape[1]

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.detach().clone())

    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    experts = [(param(gate_up[e, :width]), param(gate_up[e, width:]), param(down[e]))
               for e in range(EXPERTS)]
    shared = getattr(block, "shared_expert", None)
    return MoEUnit(
        0, param(torch.ones(hidden, dtype=BF16)), param(block.gate.weight), experts,
        top_k=TOP_K, norm_topk_prob=norm, eps=eps, one_graph=True,
        shared=None if shared is None else (param(shared.gate_proj.weight),
                                            param(shared.up_proj.weight),
                                            param(shared.down_proj.weight)),
        shared_gate=None if shared is None else param(block.shared_expert_gate.weight))


@pytest.mark.parametrize("kind", ["qwen2-moe", "qwen2-moe-renormalised", "mixtral"])
def test_the_moe_unit_in_bf16_is_transformers_block(kind: str) -> None:
    """Guards against the bf16 softmax where the stages route (MoEUnit's forward):
    the unit's output, x + block(RMSNorm(x)), and its count of routing choices per
    expert are transformers' own block's, in bf16, same weights. A token routed to
    another expert moves its output by tens of percent of the output's scale; the
    bar is 1% (observed: 0 for Qwen2-MoE, the same bits; 0.4% for Mixtral, which
    weighs its experts' outputs in float32 where stp, as Qwen2-MoE, does in bf16)."""
    block, unit = _mixtral_block() if kind == "mixtral" else _qwen2_block(
        kind.endswith("renormalised"))
    x = torch.randn(4, 32, block.gate.weight.shape[1],
                    generator=torch.Generator().manual_seed(4)).to(BF16)
    norm = Qwen2MoeRMSNorm(x.shape[-1], unit.eps).to(BF16)
    with torch.no_grad():
        h = norm(x)
        logits, _, their_ids = block.gate(h)
        theirs = x + block(h)
    assert _differ(_bf16_router_ids(logits, TOP_K), their_ids) > 0  # precision matters here
    mine = unit.forward_finish(0, unit.forward_partial(0, x))
    assert mine.dtype == BF16
    scale = theirs.abs().max()
    assert (mine.detach() - theirs).abs().max() <= 0.01 * scale
    counts = torch.bincount(their_ids.reshape(-1), minlength=EXPERTS)
    assert torch.equal(unit.counts[0], counts)
