"""The model families the cost model prices: one row each, looked up by class.

A row (`stp.costmodel.pricing.FamilyPricing`) is a family's answers: its spec
from a run's config, its time costs, its bytes per rank. Each family keeps its
row in its own package (stp.costmodel.decoder, .moe, .mllm); `derive`,
`layered_costs`, `estimate` and `spec_from_config` look the row up here instead
of testing classes. Adding a family: its package with a `pricing` row, and one
line in `FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from stp.costmodel.decoder.pricing import DECODER_PRICING
from stp.costmodel.mllm.pricing import MLLM_PRICING
from stp.costmodel.moe.pricing import MOE_PRICING
from stp.costmodel.pricing import ConfigFacts, FamilyPricing

__all__ = ["FAMILIES", "config_facts", "costs_of", "is_spec", "model_flops", "pricing_of",
           "pricing_of_config"]

FAMILIES: tuple[FamilyPricing, ...] = (
    DECODER_PRICING,
    MOE_PRICING,
    MLLM_PRICING,
)
"""Every family's row, one line each."""

_BY_SPEC = {f.spec_type: f for f in FAMILIES}
_BY_CONFIG = {f.config_type: f for f in FAMILIES}


def pricing_of(spec: Any) -> FamilyPricing:
    """The row of `spec`'s family; ValueError for an object that is no spec."""
    found = _BY_SPEC.get(type(spec))
    if found is None:
        names = ", ".join(f.spec_type.__name__ for f in FAMILIES)
        raise ValueError(f"no cost model for a {type(spec).__name__}; give one of {names} "
                         "(stp.costmodel)")
    return found


costs_of = pricing_of
"""The row's time functions are the cost functions of a spec (`derive`, `layered`)."""


def pricing_of_config(config: Any) -> FamilyPricing | None:
    """The row of the family whose config `config` is (None: no family's)."""
    return _BY_CONFIG.get(type(config))


def is_spec(model: Any) -> bool:
    """Whether `model` is a cost-model spec of some family (not a config)."""
    return type(model) in _BY_SPEC


def config_facts(config: Any) -> ConfigFacts:
    """What the reports say of a run's model; a config no family knows (a user's
    stage builder's) is taken as a decoder's."""
    row = pricing_of_config(config)
    return ConfigFacts("decoder", config) if row is None else row.facts(config)


def model_flops(spec: Any) -> float:
    """Training FLOPs of one microbatch of `spec`'s whole model (F, B and W, unsharded,
    no recomputation, attention counted full): MFU's numerator, the count `stp plan`
    reports its MFU with."""
    return pricing_of(spec).model_flops(spec)
