"""The mixture-of-experts family (Qwen2-MoE / Mixtral style, `stp.shapes.MoEConfig`):
its verbs for the layers above (stp.models.family).

Experts are TP-sharded (each expert's SwiGLU split like the dense MLP), never
whole on one TP rank; sequence parallelism is refused. With expert parallelism
(ep > 1) each rank of an EP group holds E / ep experts, each still TP-sharded
(stp.models.moe.dispatch); experts must divide by ep. The router and the
shared expert's gate are replicated over TP; each rank's gradient of them is a
partial sum (the routing weights scale TP partial outputs), so they are summed
over the TP group with the other shared gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.spec import ModelSpec
from stp.models.decoder.init import count_parameters
from stp.models.decoder.shared_grads import SharedGrads
from stp.models.decoder.stage import check_model
from stp.models.family import ModelFamily, StageBuilder, check_text_batch
from stp.models.moe.dispatch import ExpertGroup
from stp.models.moe.init import moe_parameter_specs
from stp.models.moe.reference import build_moe_reference
from stp.models.moe.stage import build_moe_stage, check_moe_tp
from stp.models.placement import placed_builder
from stp.schedule.placement import partition_layers
from stp.shapes.moe import MoEConfig

__all__ = ["MOE", "MoEFamily"]

_TP_PARTIAL = (".moe.router.weight", ".moe.shared_gate.weight")
"""Replicated parameters whose gradient each TP rank holds a part of."""


class MoEFamily(ModelFamily):
    name = "moe"
    config_type = MoEConfig

    def check(self, config: MoEConfig, tp: int, num_stages: int) -> None:
        check_model(config, tp, num_stages)
        check_moe_tp(config, tp, 0)

    def check_ep(self, config: MoEConfig, ep: int) -> None:
        """ValueError unless the routed experts split over `ep` expert-parallel ranks."""
        if config.num_experts % ep:
            raise ValueError(f"--experts {config.num_experts} must be divisible by --ep {ep} "
                             "(each expert-parallel rank holds experts / ep of them)")

    def num_layers(self, config: MoEConfig) -> int:
        return config.num_layers

    def hidden(self, config: MoEConfig) -> int:
        return config.hidden

    def parameter_count(self, config: MoEConfig) -> int:
        return count_parameters(moe_parameter_specs(config))

    def stage_builder(self, config: MoEConfig, num_stages: int, *,
                      partition: tuple[int, ...] | None,
                      weights: Callable[..., torch.Tensor] | None = None,
                      sequence_parallel: bool = False,
                      recompute: str = "none") -> StageBuilder:
        if recompute != "none":
            raise ValueError(f"recompute={recompute!r}: the mixture-of-experts stages "
                             "do not recompute yet; use recompute='none'")
        if sequence_parallel:
            raise ValueError("--sequence-parallel: the MoE model has no sequence parallelism")
        if partition is not None:
            partition_layers(config.num_layers, num_stages, partition)  # ValueError
        read: dict[str, Any] = {} if weights is None else {"weights": weights}
        return placed_builder(build_moe_stage, config, partition=partition, **read)

    def check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        check_text_batch(tokens, targets)

    def reference(self, config: MoEConfig, dtype: torch.dtype) -> torch.nn.Module:
        return build_moe_reference(config, dtype)

    def cost_spec(self, config: MoEConfig, *, sequence: int, micro_batch: int,
                  tp: int) -> ModelSpec:
        # the cost model's MoE view (stp.costmodel.moe): the routed copies, the router
        # and every expert's weights, not only the top-k a token computes
        return spec_from_config(config, seq_len=sequence, microbatch_size=micro_batch, tp=tp)

    def shared_grads(self, config: MoEConfig, stages: Mapping[int, Any], schedule: Any,
                     mesh: Any) -> SharedGrads:
        shared = SharedGrads.on_mesh(config, stages, schedule, mesh)
        if mesh.dims.tp > 1:
            shared.row_sums += [n for st in stages.values() for n in st.specs
                                if n.endswith(_TP_PARTIAL)]
        return shared

    def describe(self, config: MoEConfig, *, params: str, ep: int) -> str:
        return (f"{config.num_layers}x{config.hidden} ({params} params), moe "
                f"{config.num_experts} experts top-{config.top_k} ep{ep}")

    def builder_on_mesh(self, builder: StageBuilder, mesh: Any) -> StageBuilder:
        if mesh.dims.ep == 1:
            return builder
        return functools.partial(builder, expert_group=ExpertGroup(mesh.ep_group, mesh.dims.ep,
                                                                   mesh.ep_rank))


MOE = MoEFamily()
