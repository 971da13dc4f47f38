"""The decoder's cost spec from the config a run builds, and from the decoder fields
of a Hugging Face config.json (read without torch; `stp.models.hf.config` is the
torch-side reader that builds the model itself)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from stp.costmodel.decoder.spec import ModelSpec
from stp.shapes import ModelConfig

__all__ = ["HF_FIELDS", "decoder_spec_from_config", "decoder_spec_from_hf_json",
           "spec_fields"]

HF_FIELDS = (("hidden_size", "hidden"), ("num_hidden_layers", "layers"),
             ("num_attention_heads", "heads"), ("intermediate_size", "ffn"),
             ("vocab_size", "vocab"))
"""transformers' names of the decoder fields every config.json carries."""


def decoder_spec_from_config(config: ModelConfig, *, seq_len: int, microbatch_size: int = 1,
                             tp: int = 1, flash_attention: bool = True) -> ModelSpec:
    """The cost model's view of a decoder `config` (without dropout, as stp's runtime
    builds it; `flash_attention`: the fused attention kernel keeps no s x s scores;
    an explicit head_dim is approximated, see below)."""
    # A config.json `head_dim` other than hidden / heads (Llama 3.2 1B, Gemma) makes the
    # attention's width differ from the residual stream's; the spec has one width, the
    # residual's, so such a model's attention is priced as if head_dim = hidden / heads.
    return ModelSpec(layers=config.num_layers, hidden=config.hidden, heads=config.num_heads,
                     kv_heads=config.num_kv_heads, ffn=config.ffn, vocab=config.vocab_size,
                     sequence=seq_len, micro_batch=microbatch_size, tp=tp, gated_mlp=True,
                     flash_attention=flash_attention, dropout=False, name="config")


def spec_fields(spec: ModelSpec) -> dict[str, Any]:
    """The decoder fields of `spec`, to build a spec of a family built on it."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)}


def decoder_spec_from_hf_json(obj: Mapping, where: str) -> ModelSpec:
    """A decoder spec from the decoder fields of a parsed config.json (Llama, Qwen2 and
    any model with their field names); ValueError naming the file and field."""
    vals: dict[str, Any] = {}
    for key, field in (*HF_FIELDS, ("num_key_value_heads", "kv_heads")):
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
        return ModelSpec(**vals, sequence=1, gated_mlp=act in ("silu", "swiglu"),
                         flash_attention=True, dropout=False, name=name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
