"""The mixture of experts' cost spec from the config a run builds, and from a
Qwen2-MoE or Mixtral config.json (transformers' names), on top of the decoder's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stp.costmodel.decoder.configs import decoder_spec_from_config, spec_fields
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.moe.spec import MoESpec
from stp.shapes import MoEConfig

__all__ = ["HF_MODEL_TYPES", "moe_spec_from_config", "moe_spec_from_hf_json"]

HF_MODEL_TYPES = ("qwen2_moe", "mixtral")
"""config.json model types whose experts the cost model reads."""


def moe_spec_from_config(config: MoEConfig, *, seq_len: int, microbatch_size: int = 1,
                         tp: int = 1, flash_attention: bool = True) -> MoESpec:
    """The cost model's view of an MoE `config`: its decoder's, with every expert's
    weights, the routed copies and the router (stp.costmodel.moe.spec)."""
    base = decoder_spec_from_config(config, seq_len=seq_len, microbatch_size=microbatch_size,
                                    tp=tp, flash_attention=flash_attention)
    return MoESpec(**spec_fields(base), experts=config.num_experts, top_k=config.top_k,
                   expert_ffn=config.expert_ffn, shared_expert_ffn=config.shared_expert_ffn,
                   moe_every=config.moe_every)


def moe_spec_from_hf_json(obj: Mapping, base: ModelSpec, where: str) -> MoESpec:
    """A mixture of experts' fields of a Qwen2-MoE or Mixtral config.json on top of
    the decoder fields `base` read (transformers' names)."""
    mixtral = obj.get("model_type") == "mixtral"
    names = ((("num_local_experts", "experts"), ("num_experts_per_tok", "top_k"),
              ("intermediate_size", "expert_ffn")) if mixtral else
             (("num_experts", "experts"), ("num_experts_per_tok", "top_k"),
              ("moe_intermediate_size", "expert_ffn"),
              ("shared_expert_intermediate_size", "shared_expert_ffn"),
              ("decoder_sparse_step", "moe_every")))
    vals: dict[str, Any] = {}
    for key, field in names:
        raw = obj.get(key, 0 if field == "shared_expert_ffn" else 1 if field == "moe_every"
                      else None)
        low = 0 if field == "shared_expert_ffn" else 1
        if isinstance(raw, bool) or not isinstance(raw, int) or not low <= raw <= 1 << 24:
            raise ValueError(f"{where}: {key}={raw!r}; expected an integer {low}..{1 << 24}")
        vals[field] = raw
    if obj.get("mlp_only_layers"):
        raise ValueError(f"{where}: mlp_only_layers={obj['mlp_only_layers']!r}: the cost "
                         "model prices MoE layers every decoder_sparse_step layers only")
    try:
        return MoESpec(**spec_fields(base), **vals)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
