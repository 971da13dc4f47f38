"""The mixture of experts' row of the family table (stp.costmodel.pricing): a
decoder whose MLP hooks and all-to-all (stp.costmodel.moe.spec) the decoder's
time and memory functions read."""

from __future__ import annotations

from dataclasses import replace

from stp.costmodel.decoder.pricing import DECODER_PRICING
from stp.costmodel.moe.configs import HF_MODEL_TYPES, moe_spec_from_config, moe_spec_from_hf_json
from stp.costmodel.moe.spec import MoESpec
from stp.costmodel.pricing import ConfigFacts
from stp.shapes import MoEConfig

__all__ = ["MOE_PRICING"]


def _facts(config: MoEConfig) -> ConfigFacts:
    return ConfigFacts("moe", config, experts=config.num_experts, top_k=config.top_k)


MOE_PRICING = replace(
    DECODER_PRICING, name="moe", spec_type=MoESpec, config_type=MoEConfig,
    from_config=moe_spec_from_config, facts=_facts, hf_model_types=HF_MODEL_TYPES,
    from_hf_json=moe_spec_from_hf_json)
