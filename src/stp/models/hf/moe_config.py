"""Hugging Face `config.json` <-> MoEConfig for Qwen2-MoE (`qwen2_moe`) and Mixtral
(`mixtral`).

The attention half is read as the decoder's (stp.models.hf.config: Qwen2's for
qwen2_moe, with q/k/v biases; Llama's for mixtral), with the same refusals;
the MoE fields are bounded and read here, and whatever would make stp compute
something else than transformers is refused naming the field: dense layers
picked by `mlp_only_layers`, router jitter, sliding windows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stp.models.hf.config import _short, config_from_hf, config_to_hf
from stp.shapes.decoder import ModelConfig
from stp.shapes.moe import HF_MOE_TYPES, MoEConfig

__all__ = ["moe_config_from_hf", "moe_config_to_hf"]

_ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# config.json field -> (smallest, largest accepted)
_MOE_INTS = {"num_experts": (1, 1024), "num_local_experts": (1, 1024),
             "num_experts_per_tok": (1, 1024), "moe_intermediate_size": (1, 2**20),
             "shared_expert_intermediate_size": (0, 2**20), "decoder_sparse_step": (1, 1024)}
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "shared_expert_intermediate_size", "decoder_sparse_step", "norm_topk_prob",
             "router_aux_loss_coef", "mlp_only_layers", "router_jitter_noise",
             "output_router_logits", "qkv_bias", "sliding_window", "max_window_layers")


def _moe_int(raw: dict[str, Any], field: str, where: str, default: Any = None) -> int:
    value = raw.get(field, default)
    lo, hi = _MOE_INTS[field]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{where}: {field}={_short(value)} is not accepted: stp accepts an "
                         f"integer from {lo} to {hi}")
    return value


def _refusals(raw: dict[str, Any], where: str) -> None:
    if raw.get("mlp_only_layers"):
        raise ValueError(f"{where}: mlp_only_layers={_short(raw['mlp_only_layers'])} is not "
                         "supported (stp picks dense layers by decoder_sparse_step only)")
    if raw.get("router_jitter_noise", 0.0) not in (0, 0.0, None):
        raise ValueError(f"{where}: router_jitter_noise={_short(raw['router_jitter_noise'])} is "
                         "not supported (stp routes without noise)")
    if raw.get("model_type") == "mixtral" and raw.get("sliding_window") is not None:
        raise ValueError(f"{where}: sliding_window={_short(raw['sliding_window'])} is not "
                         "supported (stp computes full attention)")
    coef = raw.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef <= 1e3:
        raise ValueError(f"{where}: router_aux_loss_coef={_short(coef)} is not accepted: stp "
                         "accepts a number from 0 to 1000")
    if not isinstance(raw.get("norm_topk_prob", False), bool):
        raise ValueError(f"{where}: norm_topk_prob must be true or false, got "
                         f"{_short(raw['norm_topk_prob'])}")


def moe_config_from_hf(raw: dict[str, Any], where: str = "config.json") -> MoEConfig:
    """The MoEConfig of a qwen2_moe or mixtral config.json (`where` names it in errors)."""
    kind = raw.get("model_type")
    if kind not in HF_MOE_TYPES:
        raise ValueError(f"{where}: model_type={kind!r} is not a mixture of experts stp reads "
                         f"({', '.join(HF_MOE_TYPES)})")
    _refusals(raw, where)
    base_raw = {k: v for k, v in raw.items() if k not in _MOE_KEYS}
    base_raw["model_type"] = "qwen2" if kind == "qwen2_moe" else "llama"
    base = config_from_hf(base_raw, where)
    if kind == "qwen2_moe":
        qkv = raw.get("qkv_bias", True)
        if not isinstance(qkv, bool):
            raise ValueError(f"{where}: qkv_bias must be true or false, got {_short(qkv)}")
        moe = dict(num_experts=_moe_int(raw, "num_experts", where),
                   expert_ffn=_moe_int(raw, "moe_intermediate_size", where),
                   shared_expert_ffn=_moe_int(raw, "shared_expert_intermediate_size", where, 0),
                   moe_every=_moe_int(raw, "decoder_sparse_step", where, 1),
                   norm_topk_prob=raw.get("norm_topk_prob", False))
        base = dataclasses.replace(base, qkv_bias=qkv)
    else:
        moe = dict(num_experts=_moe_int(raw, "num_local_experts", where),
                   expert_ffn=base.ffn, shared_expert_ffn=0, moe_every=1, norm_topk_prob=True)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    try:
        return MoEConfig(**fields, **moe, top_k=_moe_int(raw, "num_experts_per_tok", where),
                         aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
                         hf_type=kind)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def moe_config_to_hf(config: MoEConfig, dtype: str,
                     base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `config`: the source checkpoint's own `base` (checked to describe
    the same model) or a fresh one of config.hf_type."""
    if base is not None:
        described = moe_config_from_hf(base, "the source config.json")
        if dataclasses.replace(described, seed=config.seed) != config:
            raise ValueError("the model no longer matches its source config.json; "
                             "save without a source config")
        raw = dict(base)
        raw.pop("torch_dtype", None)
        raw["dtype"] = dtype
        if "torch_dtype" in base:
            raw["torch_dtype"] = dtype
        return raw
    kind = config.hf_type
    if kind == "qwen2_moe" and not config.shared_expert_ffn:
        raise ValueError("a Qwen2-MoE checkpoint has a shared expert: this model has none "
                         "(give --shared-expert-ffn, or train a Mixtral-shaped model: an MoE "
                         "MLP in every layer, renormalised top-k)")
    raw = config_to_hf(dataclasses.replace(
        _decoder_half(config), qkv_bias=config.qkv_bias if kind == "qwen2_moe" else False),
        dtype)
    raw["architectures"] = [_ARCHITECTURES[kind]]
    raw["model_type"] = kind
    raw["num_experts_per_tok"] = config.top_k
    raw["router_aux_loss_coef"] = config.aux_loss_coef
    raw["output_router_logits"] = False
    if kind == "qwen2_moe":
        raw.update(num_experts=config.num_experts, moe_intermediate_size=config.expert_ffn,
                   shared_expert_intermediate_size=config.shared_expert_ffn,
                   decoder_sparse_step=config.moe_every, norm_topk_prob=config.norm_topk_prob,
                   mlp_only_layers=[], qkv_bias=config.qkv_bias, use_sliding_window=False)
    else:
        raw.update(num_local_experts=config.num_experts, intermediate_size=config.expert_ffn,
                   router_jitter_noise=0.0, sliding_window=None)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
            raw.pop(key, None)
    return raw


def _decoder_half(config: MoEConfig) -> ModelConfig:
    """The attention and vocabulary half of `config`, as a plain ModelConfig."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: getattr(config, k) for k in names})
