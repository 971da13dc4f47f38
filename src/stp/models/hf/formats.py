"""One row per family that has a Hugging Face checkpoint layout: how its config is
written to `config.json`, which parameters its checkpoint holds, how its keys are
named and how its single-process reference is built. The checkpoint code asks this
table instead of testing a config's class, so a family with a new layout is one
row here (the families never import stp.models.hf: the format sits above them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stp.models.decoder.init import ParamSpec, parameter_specs
from stp.models.decoder.reference import build_reference
from stp.models.hf.config import config_to_hf
from stp.models.hf.moe_config import moe_config_to_hf
from stp.models.moe.init import moe_parameter_specs
from stp.models.moe.reference import build_moe_reference
from stp.shapes.decoder import ModelConfig
from stp.shapes.moe import MoEConfig

__all__ = ["HFFormat", "format_of"]


@dataclass(frozen=True)
class HFFormat:
    """How one family's checkpoints look in the Hugging Face layout."""

    specs: Callable[[Any], list[ParamSpec]]
    """Every parameter of the model a config describes."""
    layout: Callable[[Any], str]
    """The key layout for stp.models.hf.names ("" for the decoder's)."""
    to_hf: Callable[..., dict[str, Any]]
    """config -> config.json's object: (config, dtype name, the source's raw config)."""
    reference: Callable[..., Any]
    """(config, dtype, full tensors) -> the single-process reference model."""


_FORMATS: dict[type, HFFormat] = {
    ModelConfig: HFFormat(parameter_specs, lambda config: "", config_to_hf, build_reference),
    MoEConfig: HFFormat(moe_parameter_specs, lambda config: config.hf_type, moe_config_to_hf,
                        build_moe_reference),
}


def format_of(config: ModelConfig) -> HFFormat:
    """The row of `config`'s class (its nearest registered base: a subclass of
    ModelConfig the table does not name is written as a decoder)."""
    for cls in type(config).__mro__:
        row = _FORMATS.get(cls)
        if row is not None:
            return row
    raise ValueError(f"no Hugging Face checkpoint layout for a {type(config).__name__}")
