"""Cost-model specs from the shapes a run is given: a `stp.shapes.ModelConfig`
(what `stp train` builds) or the few fields of a Hugging Face `config.json`
the cost model needs, read without torch (`stp.models.hf.config` is the
torch-side reader that builds the model itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.moe.spec import MoESpec
from stp.shapes import ModelConfig, MoEConfig

__all__ = ["spec_from_config", "spec_from_hf_json", "HF_MAX_BYTES"]

HF_MAX_BYTES = 1 << 20
"""Largest config.json read (a real one is a few KB)."""
_HF_FIELDS = (("hidden_size", "hidden"), ("num_hidden_layers", "layers"),
              ("num_attention_heads", "heads"), ("intermediate_size", "ffn"),
              ("vocab_size", "vocab"))


def spec_from_config(config: ModelConfig, *, seq_len: int, microbatch_size: int = 1,
                     tp: int = 1, flash_attention: bool = True) -> ModelSpec:
    """The cost model's view of `config` (a decoder without dropout, as stp's
    runtime builds it; `flash_attention`: the fused attention kernel keeps no
    s x s scores; an explicit head_dim is approximated, see below)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"a memory estimate needs a decoder ModelConfig, not a "
                         f"{type(config).__name__}")
    # A config.json `head_dim` other than hidden / heads (Llama 3.2 1B, Gemma) makes the
    # attention's width differ from the residual stream's; the spec has one width, the
    # residual's, so such a model's attention is priced as if head_dim = hidden / heads.
    spec = ModelSpec(layers=config.num_layers, hidden=config.hidden, heads=config.num_heads,
                     kv_heads=config.num_kv_heads, ffn=config.ffn, vocab=config.vocab_size,
                     sequence=seq_len, micro_batch=microbatch_size, tp=tp, gated_mlp=True,
                     flash_attention=flash_attention, dropout=False, name="config")
    if isinstance(config, MoEConfig):
        return MoESpec(**_fields(spec), experts=config.num_experts, top_k=config.top_k,
                       expert_ffn=config.expert_ffn,
                       shared_expert_ffn=config.shared_expert_ffn, moe_every=config.moe_every)
    return spec


def _fields(spec: ModelSpec) -> dict[str, object]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}


def _moe_json(obj: Mapping, base: ModelSpec, where: str) -> MoESpec:
    """A mixture of experts' fields of a Qwen2-MoE or Mixtral config.json on top of
    the decoder fields `base` read (transformers' names)."""
    mixtral = obj.get("model_type") == "mixtral"
    names = ((("num_local_experts", "experts"), ("num_experts_per_tok", "top_k"),
              ("intermediate_size", "expert_ffn")) if mixtral else
             (("num_experts", "experts"), ("num_experts_per_tok", "top_k"),
              ("moe_intermediate_size", "expert_ffn"),
              ("shared_expert_intermediate_size", "shared_expert_ffn"),
              ("decoder_sparse_step", "moe_every")))
    vals: dict[str, int] = {}
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
    return MoESpec(**_fields(base), **vals)


def spec_from_hf_json(obj: object, where: str) -> ModelSpec:
    """A decoder spec from a parsed Hugging Face config.json (Llama, Qwen2 and
    any model with their field names); ValueError naming the file and field."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: a config.json is a JSON object")
    moe = obj.get("model_type") in ("qwen2_moe", "mixtral")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if obj.get(key) and not moe:  # its intermediate_size is one expert's: wrong dense
            raise ValueError(f"{where}: {key}={obj[key]!r}: the cost model prices the "
                             "mixture-of-experts layouts of qwen2_moe and mixtral only")
    vals: dict[str, int] = {}
    for key, field in (*_HF_FIELDS, ("num_key_value_heads", "kv_heads")):
        raw = obj.get(key, obj.get("num_attention_heads") if field == "kv_heads" else None)
        if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 1 << 24:
            raise ValueError(f"{where}: {key}={raw!r}; expected an integer 1..{1 << 24}")
        vals[field] = raw
    head_dim = obj.get("head_dim")
    if head_dim is not None and head_dim * vals["heads"] != vals["hidden"]:
        raise ValueError(f"{where}: head_dim={head_dim!r} x num_attention_heads != "
                         "hidden_size; the cost model assumes hidden = heads x head_dim")
    act = obj.get("hidden_act", "silu")
    name = str(obj.get("model_type", "config.json"))[:40]
    try:
        spec = ModelSpec(**vals, sequence=1, gated_mlp=act in ("silu", "swiglu"),
                         flash_attention=True, dropout=False, name=name)
        return _moe_json(obj, spec, where) if moe else spec
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
