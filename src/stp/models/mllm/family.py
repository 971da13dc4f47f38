"""The multimodal family (a vision encoder in front of the decoder,
`stp.shapes.MLLMConfig`): its verbs for the layers above (stp.models.family)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from stp.costmodel.mllm.configs import mllm_spec_from_config
from stp.costmodel.mllm.spec import MLLMSpec
from stp.models.decoder.init import count_parameters
from stp.models.decoder.shared_grads import SharedGrads
from stp.models.family import ModelFamily, StageBuilder
from stp.models.mllm.reference import build_mllm_reference
from stp.models.mllm.stage import build_mllm_stage, check_mllm, mllm_specs
from stp.models.placement import placed_builder
from stp.models.recompute import check_recompute
from stp.schedule.placement import partition_layers
from stp.shapes.mllm import MLLMConfig

__all__ = ["MLLM", "MLLMFamily"]


class MLLMFamily(ModelFamily):
    name = "mllm"
    config_type = MLLMConfig
    hf_refusal = ("the multimodal model cannot be saved as a Hugging Face checkpoint: stp's "
                  "vision encoder and merger have no Hugging Face layout")

    def check(self, config: MLLMConfig, tp: int, num_stages: int) -> None:
        check_mllm(config, tp, num_stages)

    def num_layers(self, config: MLLMConfig) -> int:
        return config.num_layers  # encoder blocks first, then decoder layers

    def hidden(self, config: MLLMConfig) -> int:
        return config.hidden

    def parameter_count(self, config: MLLMConfig) -> int:
        return count_parameters(mllm_specs(config))

    def stage_builder(self, config: MLLMConfig, num_stages: int, *,
                      partition: tuple[int, ...] | None,
                      weights: Callable[..., torch.Tensor] | None = None,
                      sequence_parallel: bool = False,
                      recompute: str = "none") -> StageBuilder:
        check_recompute(recompute)  # every mode: the encoder's units recompute too
        if weights is not None:
            raise ValueError("the multimodal model has no Hugging Face layout to read weights "
                             "from; it starts from its seeded initialisation")
        if partition is not None:
            partition_layers(config.num_layers, num_stages, partition)  # ValueError
        return placed_builder(build_mllm_stage, config, partition=partition,
                              sequence_parallel=sequence_parallel, recompute=recompute)

    def check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        # an input row is pixel bytes + tokens, its targets cover the decoder's positions
        # (image tokens + tokens): only the rows must agree
        if tokens.dim() != 2 or tokens.shape[0] != targets.shape[0]:
            raise ValueError(
                f"batch needs tokens and targets of one shape [B, s], got "
                f"{tuple(tokens.shape)} and {tuple(targets.shape)}"
            )

    def reference(self, config: MLLMConfig, dtype: torch.dtype) -> torch.nn.Module:
        return build_mllm_reference(config, dtype)

    def cost_spec(self, config: MLLMConfig, *, sequence: int, micro_batch: int,
                  tp: int) -> MLLMSpec:
        # one image per sample and the caption's text (stp.costmodel.mllm.configs)
        return mllm_spec_from_config(config, seq_len=sequence, microbatch_size=micro_batch,
                                     tp=tp)

    def describe(self, config: MLLMConfig, *, params: str, ep: int) -> str:
        vis, dec = config.vision, config.decoder
        return (f"vision {vis.num_layers}x{vis.hidden} ({vis.image_size}-px images, patch "
                f"{vis.patch_size}, merge {vis.merge}) + decoder {dec.num_layers}x{dec.hidden} "
                f"({params} params)")

    def shared_grads(self, config: MLLMConfig, stages: Mapping[int, Any], schedule: Any,
                     mesh: Any) -> SharedGrads:
        # the decoder's: kv heads replicated when fewer than TP ranks (the encoder has
        # as many kv heads as heads, and the multimodal model never ties its embedding)
        return SharedGrads.on_mesh(config.decoder, stages, schedule, mesh)


MLLM = MLLMFamily()
