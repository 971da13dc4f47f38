"""Cost-model specs from the shapes a run is given: the config `stp train` builds
(one of `stp.shapes`') or the few fields of a Hugging Face `config.json` the cost
model needs, read without torch. Each family reads its own (its row of
stp.costmodel.families: `from_config`, `hf_model_types`, `from_hf_json`); this
module picks the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stp.costmodel.decoder.configs import decoder_spec_from_hf_json
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.families import FAMILIES, pricing_of_config

__all__ = ["spec_from_config", "spec_from_hf_json", "HF_MAX_BYTES"]

HF_MAX_BYTES = 1 << 20
"""Largest config.json read (a real one is a few KB)."""
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that make `intermediate_size` one expert's width, not the MLP's."""


def spec_from_config(config: Any, *, seq_len: int, microbatch_size: int = 1, tp: int = 1,
                     flash_attention: bool = True) -> Any:
    """The cost model's view of `config` (stp's runtime builds it without dropout;
    `flash_attention`: the fused attention kernel keeps no s x s scores); ValueError
    for a config no family prices."""
    row = pricing_of_config(config)
    if row is None:
        raise ValueError(f"a memory estimate needs a model family's config, not a "
                         f"{type(config).__name__}")
    return row.from_config(config, seq_len=seq_len, microbatch_size=microbatch_size, tp=tp,
                           flash_attention=flash_attention)


def spec_from_hf_json(obj: object, where: str) -> ModelSpec:
    """A decoder spec (a mixture of experts' for the model types a family reads) from
    a parsed Hugging Face config.json; ValueError naming the file and field."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: a config.json is a JSON object")
    model_type = obj.get("model_type")
    row = next((f for f in FAMILIES if model_type in f.hf_model_types), None)
    for key in _EXPERT_KEYS:
        if obj.get(key) and row is None:  # its intermediate_size is one expert's: wrong dense
            types = " and ".join(t for f in FAMILIES for t in f.hf_model_types)
            raise ValueError(f"{where}: {key}={obj[key]!r}: the cost model prices the "
                             f"mixture-of-experts layouts of {types} only")
    base = decoder_spec_from_hf_json(obj, where)
    return base if row is None or row.from_hf_json is None else row.from_hf_json(obj, base,
                                                                                  where)
