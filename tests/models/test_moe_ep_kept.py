"""What an expert-parallel MoE layer's three units share for a microbatch (the routing
plan, the sorted routing weights, the shared expert's output, the layer input;
stp.models.moe.ep_units._Mb) is kept by the route unit, so activation offload
moves it and the memory count sees it (stp.runtime.offload reads kept_tensors)."""

from __future__ import annotations

import torch

from stp.models import StagePlacement
from stp.models.moe.dispatch import ExpertGroup, Routed
from stp.models.moe.ep_units import RouteUnit, _Mb
from stp.models.moe.stage import build_moe_stage
from stp.shapes import MoEConfig


def test_the_route_unit_keeps_what_the_layer_units_share():
    cfg = MoEConfig(vocab_size=40, hidden=16, num_layers=1, num_heads=2, num_kv_heads=1,
                    ffn_hidden=32, max_seq_len=8, num_experts=4, top_k=2, expert_ffn=8)
    stage = build_moe_stage(cfg, StagePlacement(0, 1), expert_group=ExpertGroup(None, 2, 0))
    (route,) = [u for u in stage.units if isinstance(u, RouteUnit)]
    n, k, h = 6, 2, 16
    plan = Routed(torch.arange(n * k), torch.arange(n * k) // k, [6, 6], [5, 7],
                  torch.zeros(12, dtype=torch.long), None)
    mb = _Mb(plan, torch.rand(n * k), torch.rand(n, h), torch.rand(1, n, h),
             torch.Size((1, n, h)))
    route.layer.mbs[3] = mb
    kept = {id(t) for t in route.kept_tensors(3)}
    shared = (plan.order, plan.token, plan.expert, mb.weights, mb.shared, mb.x)
    assert all(id(t) in kept for t in shared)
    assert route.kept_tensors(2) == []  # another microbatch keeps nothing of it
    mb.x = mb.shared = None  # the combine unit drops them once used in the forward
    assert len(route.kept_tensors(3)) == 4
