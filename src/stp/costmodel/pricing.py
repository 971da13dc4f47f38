"""What a model family answers the cost model: one `FamilyPricing` row per family.

A row pairs the family's spec and config classes with the functions that price
them: time (one rank's share, per-stage costs, the partition check, MFU's FLOPs),
bytes (the estimate of `stp memory` and `stp train`'s pre-launch check) and the
spec made from a run's config or a config.json. Each family keeps its row in its
own package (`stp.costmodel.<family>.pricing`); stp.costmodel.families lists the
rows, so the shared code asks a row and never tests a class. The questions the
shared decoder formulas ask of a spec itself (its ep, experts, router, all-to-all)
are the spec's methods (stp.costmodel.decoder.spec).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigFacts", "FamilyPricing"]


@dataclass(frozen=True)
class ConfigFacts:
    """What the reports say of a run's model, read from its config."""

    family: str
    """The family's name (`stp train --arch`)."""
    decoder: Any
    """The decoder's config (layers, hidden, heads, vocab; a `stp.shapes.ModelConfig`)."""
    experts: int = 0
    """Routed experts per MoE layer (0: none)."""
    top_k: int = 0
    """Experts each token goes to (0: no experts)."""
    vision: Any = None
    """The vision encoder's config in front of the decoder (None: none)."""


@dataclass(frozen=True)
class FamilyPricing:
    """How one family is priced (see the module doc)."""

    name: str
    """The family's name, as `stp train --arch` spells it."""
    spec_type: type
    """Its cost-model spec class; a spec of this exact type is priced by this row."""
    config_type: type
    """Its config class in stp.shapes; a config of this exact type belongs to it."""
    from_config: Callable[..., Any]
    """(config, *, seq_len, microbatch_size, tp, flash_attention) -> the spec."""
    facts: Callable[[Any], ConfigFacts]
    """config -> what the reports say of the model."""
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
    no recomputation): what MFU divides."""
    estimate: Callable[..., Any]
    """(spec, hardware, layout, features, schedule) -> (MemoryEstimate, SimResult):
    bytes per pipeline rank of a step and the simulated step (stp.costmodel.memory)."""
    hf_model_types: tuple[str, ...] = ()
    """config.json `model_type`s this family reads (`from_hf_json`); the decoder's
    fields are read for every other type."""
    from_hf_json: Callable[..., Any] | None = None
    """(parsed config.json, the decoder spec its decoder fields make, where) -> the
    family's spec."""
