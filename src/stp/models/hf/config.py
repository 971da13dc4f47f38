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
        from stp.shapes.moe import HF_MOE_TYPES  # read by models.hf.moe_config, not here

        kinds = [*SUPPORTED_TYPES, *HF_MOE_TYPES]
        accepted = f"stp loads {', '.join(kinds[:-1])} and {kinds[-1]} checkpoints"
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
    if not isinstance(layer_types, list):
        raise _refuse(where, "layer_types", _short(layer_types), "a list of attention kinds")
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(where, "layer_types", layer_types, "only full attention is supported")
    if raw.get("quantization_config"):
        raise _refuse(where, "quantization_config", "...", "quantised weights are not supported")
    return model_type


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(theta, Llama 3 scaling or None) from either spelling of the rotary settings."""
    for field in ("rope_parameters", "rope_scaling"):
        if raw.get(field) is not None and not isinstance(raw[field], dict):
            raise ValueError(f"{where}: {field} must be an object, got {_short(raw[field])}")
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    spec = scaling or params
    kind = spec.get("rope_type", spec.get("type", "default"))
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(where, "partial_rotary_factor", spec["partial_rotary_factor"],
                      "stp rotates whole heads")
    if kind in (None, "default"):
        return _bounded_float(theta, "rope_theta", where), None
    if kind != "llama3":
        field = "rope_scaling" if scaling else "rope_parameters"
        raise _refuse(where, f"{field}.rope_type", kind, "stp supports llama3 or none")
    original = spec.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    factors = {k: _bounded_float(spec.get(k), k, f"{where}: llama3 rope scaling")
               for k in ("factor", "low_freq_factor", "high_freq_factor")}
    return _bounded_float(theta, "rope_theta", where), RopeScaling(
        **factors, original_max_position_embeddings=_bounded_int(
            original, "original_max_position_embeddings", where),
    )


# field -> (smallest, largest accepted, the flag bounded alike). A config.json is input
# like a flag: one huge number (num_hidden_layers: 1e9) must not make stp build 1e9
# layers' specs before it looks at the weights (it grew to 21 GB and was killed).
INT_BOUNDS: dict[str, tuple[int, int, str]] = {
    "num_hidden_layers": (1, 1024, "as --layers"),
    "hidden_size": (1, 2**17, "as --hidden"),
    "num_attention_heads": (1, 1024, "as --heads"),
    "num_key_value_heads": (1, 1024, "as --kv-heads"),
    "vocab_size": (1, 2**24, "16.7M tokens"),
    "intermediate_size": (1, 2**20, "8 x the largest --hidden"),
    "max_position_embeddings": (1, 2**24, "16.7M positions"),
    "head_dim": (1, 2**14, "16384"),
    "original_max_position_embeddings": (1, 2**24, "as max_position_embeddings"),
}
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "rope_theta": (1e-6, 1e12), "rms_norm_eps": (1e-30, 1.0), "initializer_range": (1e-30, 1e3),
    "factor": (1e-6, 1e6), "low_freq_factor": (1e-6, 1e6), "high_freq_factor": (1e-6, 1e6),
}


def _bounded_int(value: Any, field: str, where: str) -> int:
    """`value` if an integer within INT_BOUNDS[field]; else ValueError naming the field,
    the value and what is accepted."""
    lo, hi, like = INT_BOUNDS[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {field} must be an integer, got {_short(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {field}={value} is out of range: stp accepts {lo}..{hi} "
                         f"({like})")
    return value


def _bounded_float(value: Any, field: str, where: str) -> float:
    lo, hi = FLOAT_BOUNDS[field]
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"{where}: {field}={_short(value)} is not accepted: stp accepts a "
                         f"number from {lo:g} to {hi:g}")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_field(raw: dict[str, Any], field: str, where: str, default: Any = None) -> int:
    return _bounded_int(raw.get(field, default), field, where)


def config_from_hf(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Llama / Qwen2 config.json (`where` names it in errors); every
    number bounded (INT_BOUNDS, FLOAT_BOUNDS) before anything is built from it."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object of settings")
    model_type = _check_supported(raw, where)
    heads = _int_field(raw, "num_attention_heads", where)
    hidden = _int_field(raw, "hidden_size", where)
    head_dim = raw.get("head_dim")
    if head_dim is not None:
        head_dim = _bounded_int(head_dim, "head_dim", where)
    for field in ("tie_word_embeddings",):
        if not isinstance(raw.get(field, False), bool):
            raise ValueError(f"{where}: {field} must be true or false, got {_short(raw[field])}")
    pad = raw.get("pad_token_id")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
        raise ValueError(f"{where}: pad_token_id must be an integer or null, got {_short(pad)}")
    try:
        theta, scaling = _rope(raw, where)
    except ValueError as e:  # RopeScaling's own check names no file
        raise ValueError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    # every field bounded first (its own message names the file), then the model checked
    fields = dict(
        vocab_size=_int_field(raw, "vocab_size", where),
        hidden=hidden,
        num_layers=_int_field(raw, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=_int_field(raw, "num_key_value_heads", where, heads),
        ffn_hidden=_int_field(raw, "intermediate_size", where),
        max_seq_len=_int_field(raw, "max_position_embeddings", where, 2048),
        rope_theta=theta,
        norm_eps=_bounded_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        init_std=_bounded_float(raw.get("initializer_range", 0.02), "initializer_range", where),
        explicit_head_dim=None if head_dim in (None, hidden // heads) else head_dim,
        qkv_bias=model_type == "qwen2",
        tie_embeddings=raw.get("tie_word_embeddings", False),
        rope_scaling=scaling,
        pad_token_id=pad,
    )
    try:
        return ModelConfig(**fields)
    except (ValueError, TypeError) as e:
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
