"""The decoder family (Llama / Qwen2 style, `stp.shapes.ModelConfig`): its verbs
for the layers above (stp.models.family)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.spec import ModelSpec
from stp.models.decoder.init import count_parameters, parameter_specs
from stp.models.decoder.reference import build_reference
from stp.models.decoder.shared_grads import SharedGrads
from stp.models.decoder.stage import build_stage, check_model
from stp.models.decoder.stage_setup import with_tp_overlap
from stp.models.family import ModelFamily, StageBuilder, check_text_batch
from stp.models.recompute import check_recompute
from stp.schedule.placement import partition_layers
from stp.shapes.decoder import ModelConfig

__all__ = ["DECODER", "DecoderFamily"]


class DecoderFamily(ModelFamily):
    name = "decoder"
    config_type = ModelConfig

    def check(self, config: ModelConfig, tp: int, num_stages: int) -> None:
        check_model(config, tp, num_stages)

    def num_layers(self, config: ModelConfig) -> int:
        return config.num_layers

    def hidden(self, config: ModelConfig) -> int:
        return config.hidden

    def parameter_count(self, config: ModelConfig) -> int:
        return count_parameters(parameter_specs(config))

    def stage_builder(self, config: ModelConfig, num_stages: int, *,
                      partition: tuple[int, ...] | None,
                      weights: Callable[..., torch.Tensor] | None = None,
                      sequence_parallel: bool = False,
                      recompute: str = "none", tp_overlap_chunks: int = 0) -> StageBuilder:
        if partition is not None:
            partition_layers(config.num_layers, num_stages, partition)  # ValueError
        check_recompute(recompute)
        read = {} if weights is None else {"weights": weights}
        build = functools.partial(build_stage, config, partition=partition,
                                  sequence_parallel=sequence_parallel, recompute=recompute,
                                  **read)
        # in-layer TP overlap (stp.models.decoder.chunked); needs sequence_parallel
        return with_tp_overlap(build, tp_overlap_chunks) if tp_overlap_chunks else build

    def check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        check_text_batch(tokens, targets)

    def reference(self, config: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        return build_reference(config, dtype)

    def cost_spec(self, config: ModelConfig, *, sequence: int, micro_batch: int,
                  tp: int) -> ModelSpec:
        return spec_from_config(config, seq_len=sequence, microbatch_size=micro_batch, tp=tp)

    def shared_grads(self, config: ModelConfig, stages: Mapping[int, Any], schedule: Any,
                     mesh: Any) -> SharedGrads:
        return SharedGrads.on_mesh(config, stages, schedule, mesh)


DECODER = DecoderFamily()
