"""The multimodal model's row of the family table (stp.costmodel.pricing)."""

from __future__ import annotations

from stp.costmodel.mllm.configs import mllm_spec_from_config
from stp.costmodel.mllm.costs import (
    check_mllm_partition,
    derive_mllm,
    mllm_layered_costs,
    mllm_model_flops,
)
from stp.costmodel.mllm.memory import estimate_mllm
from stp.costmodel.mllm.spec import MLLMSpec
from stp.costmodel.pricing import ConfigFacts, FamilyPricing
from stp.shapes.mllm import MLLMConfig

__all__ = ["MLLM_PRICING"]


def _facts(config: MLLMConfig) -> ConfigFacts:
    return ConfigFacts("mllm", config.decoder, vision=config.vision)


MLLM_PRICING = FamilyPricing(
    name="mllm", spec_type=MLLMSpec, config_type=MLLMConfig,
    from_config=mllm_spec_from_config, facts=_facts, derive=derive_mllm,
    layered=mllm_layered_costs, check_partition=check_mllm_partition,
    model_flops=mllm_model_flops, estimate=estimate_mllm)
