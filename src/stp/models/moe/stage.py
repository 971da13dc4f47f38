"""One pipeline stage of the MoE decoder: the decoder's stage (stp.models.decoder.stage)
with each MoE layer's MLP unit replaced by an MoEUnit (stp.models.moe.units).

Layers are not fused into one unit at one TP rank (the decoder's LayerChunk):
an MoE unit's backward walks two roots (its output and its load-balancing loss),
so it stays a unit of its own. Sequence parallelism is refused (the family's
check) and experts are TP-sharded (stp.models.moe.init).

With expert parallelism (`expert_group`, stp.models.moe.dispatch) the stage holds
E / ep experts of each MoE layer under their global names, each MoE layer's MLP
is three units cut at its two all-to-alls (stp.models.moe.ep_units), which
`launch_allreduce` starts as it starts a TP all-reduce; `expert_names` lists
them, so that the trainer reduces their gradients over the replicas of those
experts (the expert-data-parallel group) and the writers of the whole model
take them from every EP rank.

The stage also carries what the trainer reads beside the loss: the
load-balancing loss of each microbatch it forwarded, and the routing counts
(`take_aux`), and it learns the number of microbatches of a step
(`set_num_microbatches`) to seed each microbatch's share of the objective.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stp.models.decoder.end_units import EmbedUnit, LossUnit
from stp.models.decoder.init import init_shard
from stp.models.decoder.stage import ModelStage, check_tp
from stp.models.decoder.stage_shards import ShardSource
from stp.models.decoder.units import AttentionUnit, MLPUnit, RopeCache, Unit
from stp.models.moe.dispatch import ExpertGroup, ToExchange
from stp.models.moe.ep_units import RouteUnit, expert_parallel_units
from stp.models.moe.init import moe_parameter_specs
from stp.models.moe.units import Expert, MoEUnit
from stp.models.placement import StagePlacement
from stp.models.tp.comm import make_allreduce
from stp.shapes.moe import MoEConfig

__all__ = ["MoEStage", "build_moe_stage"]


class MoEStage(ModelStage):
    """Layers `layer_ids` of the MoE decoder on one TP rank (a PipelineStage)."""

    config: MoEConfig

    def __init__(self, *args: Any, expert_group: ExpertGroup | None = None,
                 **kw: Any) -> None:
        self.expert_group = expert_group
        super().__init__(*args, **kw)
        self.expert_names = frozenset(
            n for n in self.specs if ".moe.experts." in n) if expert_group else frozenset()
        """Parameters held by this EP rank only (empty without expert parallelism)."""

    def _expert_ids(self) -> range:
        """The global indices of the routed experts this stage holds."""
        e = self.config.num_experts
        return range(e) if self.expert_group is None else self.expert_group.experts(e)

    def _make_units(self, p: dict[str, nn.Parameter]) -> list[Unit]:
        c, tp_size, tp_rank = self.config, self.tp_size, self.tp_rank
        vocab_part = c.padded_vocab(tp_size) // tp_size
        one_graph = tp_size == 1  # no all-reduce between a unit's norm and its body
        units: list[Unit] = []
        if self.is_first:
            units.append(EmbedUnit(p["embed.weight"], tp_rank * vocab_part, c.pad_token_id,
                                   whole_vocab=one_graph))
        rope = RopeCache(c.head_dim, c.rope_theta, c.rope_scaling)
        for i in self.layer_ids:
            a = f"layers.{i}.attn"
            biases = (p[f"{a}.wq.bias"], p[f"{a}.wk.bias"], p[f"{a}.wv.bias"]) if (
                c.qkv_bias) else None
            units.append(AttentionUnit(
                i, p[f"layers.{i}.attn_norm.weight"], p[f"{a}.wq.weight"], p[f"{a}.wk.weight"],
                p[f"{a}.wv.weight"], p[f"{a}.wo.weight"], head_dim=c.head_dim, eps=c.norm_eps,
                rope=rope, biases=biases, one_graph=one_graph,
            ))
            units.extend(self._mlp_units(p, i, one_graph))
        if self.is_last:
            head = self._slices["head.weight"]
            valid = vocab_part if head.dim is None else head.stop - head.start
            units.append(LossUnit(
                p["norm.weight"], p["head.weight"], eps=c.norm_eps,
                vocab_start=tp_rank * vocab_part, tp_size=tp_size, tp_rank=tp_rank,
                vocab_valid=valid, one_graph=one_graph,
            ))
        self.moe_units = tuple(u for u in units if isinstance(u, (MoEUnit, RouteUnit)))
        """The units that route (their load-balancing losses and counts)."""
        self.set_num_microbatches(1)
        return units

    def _mlp_units(self, p: dict[str, nn.Parameter], i: int, one_graph: bool) -> list[Unit]:
        """Layer i's MLP: dense, routed over every expert here (one unit), or with
        expert parallelism three units cut at the all-to-alls (ep_units)."""
        c, norm = self.config, p[f"layers.{i}.mlp_norm.weight"]
        if not c.is_moe_layer(i):
            m = f"layers.{i}.mlp"
            return [MLPUnit(i, norm, p[f"{m}.w1.weight"], p[f"{m}.w3.weight"],
                            p[f"{m}.w2.weight"], eps=c.norm_eps, one_graph=one_graph)]
        m = f"layers.{i}.moe."

        def swiglu(prefix: str) -> Expert:
            return (p[prefix + "w1.weight"], p[prefix + "w3.weight"], p[prefix + "w2.weight"])

        experts = [swiglu(f"{m}experts.{e}.") for e in self._expert_ids()]
        shared = swiglu(m + "shared.") if c.shared_expert_ffn else None
        route = {"top_k": c.top_k, "norm_topk_prob": c.norm_topk_prob, "eps": c.norm_eps,
                 "shared": shared, "shared_gate": p.get(m + "shared_gate.weight")}
        if self.expert_group is not None:
            return expert_parallel_units(i, norm, p[m + "router.weight"], experts,
                                         group=self.expert_group, num_experts=c.num_experts,
                                         **route)
        return [MoEUnit(i, norm, p[m + "router.weight"], experts, one_graph=one_graph,
                        **route)]

    def launch_allreduce(self, partial: Any) -> tuple[torch.Tensor, Any]:
        """An expert-parallel unit's all-to-all (ToExchange) is launched like the TP
        all-reduce, so the braid runner hides it the same way; else the decoder's."""
        if isinstance(partial, ToExchange):
            return partial.launch()
        return super().launch_allreduce(partial)

    def _reduce(self, partial: Any) -> torch.Tensor | None:
        if isinstance(partial, ToExchange):
            return partial.exchange()
        return super()._reduce(partial)

    def set_num_microbatches(self, m: int) -> None:
        """Seed each MoE unit's load-balancing loss with its share of the objective:
        aux_loss_coef x the mean over MoE layers and over the step's m microbatches
        (the DP average divides by the replicas), split over the TP ranks."""
        c = self.config
        seed = c.aux_loss_coef / (len(c.moe_layers) * m * self.tp_size)
        for unit in self.moe_units:
            unit.aux_seed = seed

    def take_aux(self) -> tuple[Any, torch.Tensor | None]:
        """(sum of the load-balancing losses this stage computed since the last call,
        over its MoE layers and microbatches; routing choices per expert, summed
        likewise; None without MoE layers); forgets them."""
        total: Any = 0.0  # a float64 tensor once a term is added: read by the trainer
        counts = None
        for unit in self.moe_units:
            for a in unit.aux.values():
                total = total + a.detach().to(torch.float64)
            for c in unit.counts.values():
                counts = c.clone() if counts is None else counts + c
            unit.aux.clear()
            unit.counts.clear()
        return total, counts


def build_moe_stage(
    config: MoEConfig,
    placement: StagePlacement,
    *,
    weights: ShardSource = init_shard,
    expert_group: ExpertGroup | None = None,
) -> MoEStage:
    """The stage `placement` names of the MoE decoder (as stp.models.decoder.stage.
    build_stage; no sequence parallelism, no recomputation yet), holding the experts
    of its rank of `expert_group` (None: all of them)."""
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
    if not isinstance(placement, StagePlacement):
        raise ValueError(f"placement must be a StagePlacement, got {type(placement).__name__}")
    p = placement
    if p.shards_sequence:
        raise ValueError("the MoE decoder has no sequence parallelism")
    if p.recompute != "none":
        raise ValueError(f"recompute={p.recompute!r}: the MoE decoder does not recompute yet")
    check_moe_tp(config, p.tp_size, p.tp_rank)
    p.check_distributed()
    experts = None if expert_group is None else expert_group.experts(config.num_experts)
    specs = moe_parameter_specs(config, p.layers(config.num_layers), first=p.is_first,
                                last=p.is_last, experts=experts)
    tensors = {s.name: weights(config, s, p.tp_size, p.tp_rank, device=p.device, dtype=p.dtype)
               for s in specs}
    return MoEStage(config, p, specs, tensors, allreduce=make_allreduce(p.tp_group, p.tp_size),
                    async_allreduce=True, fuse_layers=False, expert_group=expert_group)


def check_moe_tp(config: MoEConfig, tp_size: int, tp_rank: int) -> None:
    """ValueError unless the heads, the dense MLP and every expert split over tp_size."""
    check_tp(config, tp_size, tp_rank)
    for field in ("expert_ffn", "shared_expert_ffn"):
        value = getattr(config, field)
        if value % tp_size:
            raise ValueError(f"{field}={value} must be divisible by tp_size={tp_size} (experts "
                             "are TP-sharded like the dense MLP)")
