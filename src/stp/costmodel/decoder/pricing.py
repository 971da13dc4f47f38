"""The decoder's row of the family table (stp.costmodel.pricing)."""

from __future__ import annotations

from stp.costmodel.decoder.configs import decoder_spec_from_config
from stp.costmodel.decoder.costs import decoder_layered_costs, decoder_model_flops, derive_decoder
from stp.costmodel.decoder.memory import estimate_decoder
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.pricing import ConfigFacts, FamilyPricing
from stp.shapes import ModelConfig

__all__ = ["DECODER_PRICING", "any_partition"]


def any_partition(spec: ModelSpec, counts: tuple[int, ...]) -> None:
    """A decoder's counts are checked against its layers where they are used."""


def _facts(config: ModelConfig) -> ConfigFacts:
    return ConfigFacts("decoder", config)


DECODER_PRICING = FamilyPricing(
    name="decoder", spec_type=ModelSpec, config_type=ModelConfig,
    from_config=decoder_spec_from_config, facts=_facts, derive=derive_decoder,
    layered=decoder_layered_costs, check_partition=any_partition,
    model_flops=decoder_model_flops, estimate=estimate_decoder)
