"""Hugging Face `config.json` <-> ModelConfig for Llama and Qwen2.

Reading accepts both spellings transformers has used for rotary settings
(`rope_theta` + `rope_scaling`, and transformers 5's `rope_parameters`) and
refuses, naming the field, whatever would make stp compute something other
than transformers does: another `model_type`, sliding-window attention,
mixture-of-experts fields, biases stp does not have, other activations, other
rotary scalings, dropout, quantised weights.

Writing starts from the source checkpoint's config.json when there is one (so
a load -> save round trip keeps every field), else writes a fresh Llama config
(Qwen2 when the model has q/k/v biases).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from stp.shapes.decoder import ModelConfig, RopeScaling

__all__ = ["SUPPORTED_TYPES", "config_from_hf", "config_to_hf", "eos_token_id"]

SUPPORTED_TYPES = ("llama", "qwen2")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
               "num_experts_per_tok", "shared_expert_intermediate_size")
# field -> the value stp computes with (anything else is refused)
_REQUIRED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "partial_rotary_factor": 1.0,
}


def _refuse(where: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}: {field}={value!r} is not supported ({why})")


def _check_supported(raw: dict[str, Any], where: str) -> str:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        accepted = f"stp loads {' and '.join(SUPPORTED_TYPES)} checkpoints"
        raise _refuse(where, "model_type", model_type, accepted)
    for field, wanted in _REQUIRED.items():
        value = raw.get(field, wanted)
        if field == "attention_bias" and model_type == "qwen2":
            continue  # Qwen2's q/k/v biases are not this flag
        if value is not None and value != wanted:
            raise _refuse(where, field, value, f"stp computes with {field}={wanted!r}")
    for field in _MOE_FIELDS:
        if raw.get(field):
            raise _refuse(where, field, raw[field], "mixture-of-experts models are not supported")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(where, "layer_types", layer_types, "only full attention is supported")
    if raw.get("quantization_config"):
        raise _refuse(where, "quantization_config", "...", "quantised weights are not supported")
    return model_type


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(theta, Llama 3 scaling or None) from either spelling of the rotary settings."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    spec = scaling or params
    kind = spec.get("rope_type", spec.get("type", "default"))
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(where, "partial_rotary_factor", spec["partial_rotary_factor"],
                      "stp rotates whole heads")
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        field = "rope_scaling" if scaling else "rope_parameters"
        raise _refuse(where, f"{field}.rope_type", kind, "stp supports llama3 or none")
    original = spec.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return float(theta), RopeScaling(
        factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )


def _int_field(raw: dict[str, Any], field: str, where: str, default: Any = None) -> int:
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {field} must be an integer, got {value!r}")
    return value


def config_from_hf(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Llama / Qwen2 config.json (`where` names it in errors)."""
    model_type = _check_supported(raw, where)
    heads = _int_field(raw, "num_attention_heads", where)
    hidden = _int_field(raw, "hidden_size", where)
    head_dim = raw.get("head_dim")
    theta, scaling = _rope(raw, where)
    try:
        return ModelConfig(
            vocab_size=_int_field(raw, "vocab_size", where),
            hidden=hidden,
            num_layers=_int_field(raw, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=_int_field(raw, "num_key_value_heads", where, heads),
            ffn_hidden=_int_field(raw, "intermediate_size", where),
            max_seq_len=_int_field(raw, "max_position_embeddings", where, 2048),
            rope_theta=theta,
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            init_std=float(raw.get("initializer_range", 0.02)),
            explicit_head_dim=None if head_dim in (None, hidden // heads) else head_dim,
            qkv_bias=model_type == "qwen2",
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            pad_token_id=raw.get("pad_token_id"),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def eos_token_id(raw: dict[str, Any]) -> int | None:
    """The end-of-sequence token of a config.json (the first one when it lists several)."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def _fresh(config: ModelConfig) -> dict[str, Any]:
    model_type = "qwen2" if config.qkv_bias else "llama"
    raw: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden,
        "intermediate_size": config.ffn,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "initializer_range": config.init_std,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
    }
    if model_type == "llama":
        raw.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        raw.update(use_sliding_window=False, sliding_window=None)
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return raw


def config_to_hf(
    config: ModelConfig, dtype: str, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json for `config` with weights stored as `dtype` ("float32", ...): the
    source checkpoint's own `base` (checked to describe the same model) or a fresh one."""
    if base is not None:
        described = config_from_hf(base, "the source config.json")
        if replace(described, seed=config.seed) != config:
            raise ValueError("the model no longer matches its source config.json; "
                             "save without a source config")
        raw = dict(base)
    else:
        raw = _fresh(config)
    raw.pop("torch_dtype", None)
    raw["dtype"] = dtype
    if base is not None and "torch_dtype" in base:
        raw["torch_dtype"] = dtype  # transformers < 5 reads this spelling
    return raw
