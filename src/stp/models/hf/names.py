"""Parameter names: stp's global names <-> Hugging Face Llama / Qwen2 state-dict keys.

The tensors themselves need no transformation: stp's rotary embedding uses the
rotate-half layout of transformers' Llama and Qwen2 (no q/k row permutation),
w1 / w3 / w2 are gate_proj / up_proj / down_proj, and every matrix is stored
[out, in] on both sides.
"""

from __future__ import annotations

import re

__all__ = ["hf_name", "stp_name"]

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
    "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
}
# MoE layers (stp.models.moe.init), by Hugging Face layout (config.json model_type);
# experts are numbered the same on both sides
_MOE_LAYER = {
    "qwen2_moe": {"moe.router": "mlp.gate", "moe.shared_gate": "mlp.shared_expert_gate",
                  "moe.shared.w1": "mlp.shared_expert.gate_proj",
                  "moe.shared.w3": "mlp.shared_expert.up_proj",
                  "moe.shared.w2": "mlp.shared_expert.down_proj"},
    "mixtral": {"moe.router": "block_sparse_moe.gate"},
}
_EXPERT = {"qwen2_moe": ("mlp.experts", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
           "mixtral": ("block_sparse_moe.experts", {"w1": "w1", "w3": "w3", "w2": "w2"})}
_STP_EXPERT = re.compile(r"moe\.experts\.(\d+)\.(w[123])(\..+)")
_STP_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _map_suffix(suffix: str, table: dict[str, str]) -> str | None:
    for src, dst in table.items():
        if suffix == src:
            return dst
        if suffix.startswith(src + "."):
            return dst + suffix[len(src):]
    return None


def hf_name(name: str, layout: str = "") -> str:
    """The Hugging Face key of stp parameter `name` (ValueError if there is none);
    `layout`: the model_type of an MoE checkpoint (qwen2_moe, mixtral)."""
    if name in _TOP:
        return _TOP[name]
    m = _STP_LAYER.fullmatch(name)
    mapped = None
    if m and layout and (e := _STP_EXPERT.fullmatch(m.group(2))):
        prefix, names = _EXPERT[layout]
        mapped = f"{prefix}.{e.group(1)}.{names[e.group(2)]}{e.group(3)}"
    elif m:
        mapped = _map_suffix(m.group(2), {**_LAYER, **_MOE_LAYER.get(layout, {})})
    if m is None or mapped is None:
        raise ValueError(f"stp parameter {name!r} has no Hugging Face name")
    return f"model.layers.{m.group(1)}.{mapped}"


def stp_name(key: str, layout: str = "") -> str | None:
    """The stp parameter of Hugging Face key `key`; None for a key stp has no parameter
    for (the caller decides whether that is an error). `layout` as for hf_name."""
    for stp, hf in _TOP.items():
        if key == hf:
            return stp
    m = _HF_LAYER.fullmatch(key)
    if m is None:
        return None
    table = {**_LAYER, **_MOE_LAYER.get(layout, {})}
    mapped = _map_suffix(m.group(2), {v: k for k, v in table.items()})
    if mapped is None and layout:
        prefix, names = _EXPERT[layout]
        e = re.fullmatch(re.escape(prefix) + r"\.(\d+)\.(\w+)(\..+)", m.group(2))
        back = {hf: w for w, hf in names.items()}
        if e and e.group(2) in back:
            mapped = f"moe.experts.{e.group(1)}.{back[e.group(2)]}{e.group(3)}"
    return None if mapped is None else f"layers.{m.group(1)}.{mapped}"
