"""Each cost-model spec and its own cost functions, looked up by the spec's class.

A spec is a model family's torch-free view for the simulator (`ModelSpec`: a
decoder; `MLLMSpec`: a vision encoder in front of one). The functions that
price a spec live with its family (stp.costmodel.decoder.costs,
stp.costmodel.mllm.costs); this table is the one place that pairs them, so
that `derive` and `layered_costs` dispatch instead of testing classes, and the
multimodal costs, built on the decoder's, need not import back up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stp.costmodel.decoder.costs import decoder_layered_costs, decoder_model_flops, derive_decoder
from stp.costmodel.mllm.spec import MLLMSpec
from stp.costmodel.mllm.costs import (
    check_mllm_partition,
    derive_mllm,
    mllm_layered_costs,
    mllm_model_flops,
)
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.moe.spec import MoESpec

__all__ = ["SpecCosts", "costs_of", "model_flops"]


@dataclass(frozen=True)
class SpecCosts:
    """How one kind of spec is priced."""

    derive: Callable[..., Any]
    """(spec, hardware, pp) -> Derived: one rank's uniform share."""
    layered: Callable[..., Any]
    """(spec, hardware, pp, costs, mem, layers) -> LayeredCosts: per-layer costs with
    what the first and last stages add."""
    check_partition: Callable[[Any, tuple[int, ...]], None]
    """(spec, counts): ValueError (one line) for counts that cannot cut the model, in
    the family's own words."""
    model_flops: Callable[[Any], float]
    """spec -> training FLOPs of one microbatch of the whole model (F, B, W; unsharded,
    no recomputation): what MFU divides (`model_flops`)."""


def _any_partition(spec: ModelSpec, counts: tuple[int, ...]) -> None:
    """A decoder's counts are checked against its layers where they are used."""


_BY_SPEC: dict[type, SpecCosts] = {
    ModelSpec: SpecCosts(derive_decoder, decoder_layered_costs, _any_partition,
                          decoder_model_flops),
    # a mixture of experts is a decoder whose MLP hooks and all-to-all (costmodel.moe)
    # the decoder's functions read
    MoESpec: SpecCosts(derive_decoder, decoder_layered_costs, _any_partition,
                          decoder_model_flops),
    MLLMSpec: SpecCosts(derive_mllm, mllm_layered_costs, check_mllm_partition,
                        mllm_model_flops),
}


def costs_of(spec: Any) -> SpecCosts:
    """The cost functions of `spec`'s class; ValueError for an object that is no spec."""
    found = _BY_SPEC.get(type(spec))
    if found is None:
        raise ValueError(f"no cost model for a {type(spec).__name__}; give a ModelSpec or "
                         "an MLLMSpec (stp.costmodel)")
    return found


def model_flops(spec: Any) -> float:
    """Training FLOPs of one microbatch of `spec`'s whole model (F, B and W, unsharded,
    no recomputation, attention counted full): MFU's numerator, the count `stp plan`
    reports its MFU with."""
    return costs_of(spec).model_flops(spec)
