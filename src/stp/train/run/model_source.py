"""`stp train --model PRESET|config.json`: a randomly initialised model at a named shape.

The names are the cost model's (`stp.costmodel.presets.MODELS`, with
`,key=val` fields as `stp plan` and `stp memory` take them) or a Hugging Face
config.json (or the directory holding one), read by the same readers that
`--init-from` uses (`stp.models.hf.config`, `stp.models.hf.moe_config`), but
without any weights: the model is initialised from `--seed`. A preset's
vocabulary is kept (byte data fits in any vocabulary of 256 tokens or more; a
`--tokenizer` must fit in it). With `--init-from DIR` the weights, and so the
shape, come from DIR: `--model` must then describe the same shape.

`shape_of` is the cost model's view of a `--model` text (torch-free), which
`stp train --plan` compares with the model a plan was made for
(`differences`): a disagreement is said field by field.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stp.costmodel.decoder.spec import ModelSpec
    from stp.costmodel.moe.spec import MoESpec
    from stp.shapes import ModelConfig, MoEConfig
    from stp.train.run.config import ModelShape

__all__ = ["CORE_FIELDS", "MAX_CONFIG_BYTES", "check_shape_flags", "config_path",
           "differences", "file_sha256", "is_preset", "model_config", "shape_of"]

MAX_CONFIG_BYTES = 1 << 20
"""Largest config.json read (a real one is a few KB)."""
_SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k",
          "expert_ffn", "shared_expert_ffn", "moe_every")
"""The fields two model descriptions must share (a mixture of experts' too)."""
CORE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "vocab", "experts", "top_k")
"""The fields a config read back from a checkpoint is compared on (the MLP widths
of a mixture of experts are spelt differently by its two readers)."""
# ModelShape flag -> the config field it sets
_FLAGS = {"layers": "num_layers", "hidden": "hidden", "heads": "num_heads",
          "kv_heads": "num_kv_heads"}


def is_preset(text: str) -> bool:
    """Whether `text` names a preset (with fields) rather than a config.json / folder."""
    return not (text.endswith(".json") or Path(text).is_dir())


def config_path(text: str) -> Path:
    """The config.json `text` names: the file, or `config.json` in the folder."""
    path = Path(text)
    return path / "config.json" if path.is_dir() else path


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the file at `path` (read bounded: a config.json is small)."""
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"--model {str(path)!r}: larger than {MAX_CONFIG_BYTES} bytes; "
                         "a config.json is a few KB")
    return hashlib.sha256(data).hexdigest()


def _read_json(text: str) -> dict[str, Any]:
    from stp.files import read_json_object

    path = config_path(text)
    if not path.is_file():
        raise ValueError(f"--model {text!r}: no such file (give a preset name, a "
                         "config.json or the directory holding one)")
    return read_json_object(path, MAX_CONFIG_BYTES)


def shape_of(text: str) -> Any:
    """The cost model's spec of `--model text` (ValueError naming the bad value)."""
    if not text.isascii() or not text.strip():
        raise ValueError(f"--model {ascii(text[:60])}: a preset name or a config.json path "
                         "(ASCII) expected")
    if is_preset(text):
        from stp.costmodel import parse_model
        from stp.costmodel.mllm.spec import MLLM_MODELS

        if text.split(",")[0].strip() in MLLM_MODELS:
            raise ValueError(f"--model {text.split(',')[0]}: a multimodal preset; stp train "
                             "builds its multimodal model with --arch mllm and the vision "
                             "flags")
        return parse_model(text)
    from stp.costmodel.configs import spec_from_hf_json

    return spec_from_hf_json(_read_json(text), str(config_path(text)))


def differences(a: Any, b: Any, names: tuple[str, ...] = _SHAPE) -> list[str]:
    """`field a vs b` for each shape field where the two specs differ."""
    out = []
    for name in names:
        x, y = getattr(a, name, None), getattr(b, name, None)
        if x != y:
            out.append(f"{name} {'-' if x is None else x} vs {'-' if y is None else y}")
    return out


def model_config(text: str, seq_len: int, seed: int) -> Any:
    """The model `--model text` describes (stp.shapes: a ModelConfig, or a MoEConfig
    for a mixture of experts), to be initialised from `seed` and trained on
    `seq_len` tokens per sequence. ValueError (one line) for a name stp cannot
    build."""
    if not is_preset(text):
        return _from_json(text, seq_len, seed)
    spec = shape_of(text)
    if not spec.gated_mlp:
        raise ValueError(f"--model {text.split(',')[0]}: a GPT-style preset (GELU MLP); stp "
                         "train builds SwiGLU decoders: give a Llama / Qwen2-style preset "
                         "(qwen2-12.1b, llama3-405b, mixtral-8x7b, ...) or a config.json")
    from stp.costmodel.families import pricing_of

    fields: dict[str, Any] = dict(
        vocab_size=spec.vocab, hidden=spec.hidden, num_layers=spec.layers,
        num_heads=spec.heads, num_kv_heads=spec.kv_heads, ffn_hidden=spec.ffn,
        max_seq_len=seq_len, seed=seed)
    try:
        # the spec's family row names the family (no probing the spec for fields)
        return _PRESET_CONFIGS[pricing_of(spec).name](spec, fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--model {text}: {e}") from None


def _decoder_config(spec: ModelSpec, fields: dict[str, Any]) -> ModelConfig:
    from stp.shapes import ModelConfig as Config

    return Config(**fields)


def _moe_config(spec: MoESpec, fields: dict[str, Any]) -> MoEConfig:
    """The presets are Mixtral (no shared expert, every layer routed) and Qwen2-MoE."""
    from stp.shapes import MoEConfig as Config

    hf_type = "mixtral" if not spec.shared_expert_ffn and spec.moe_every == 1 else "qwen2_moe"
    return Config(**fields, num_experts=spec.experts, top_k=spec.top_k,
                     expert_ffn=spec.expert_ffn, shared_expert_ffn=spec.shared_expert_ffn,
                     moe_every=spec.moe_every, norm_topk_prob=hf_type == "mixtral",
                     hf_type=hf_type)


_PRESET_CONFIGS: dict[str, Any] = {"decoder": _decoder_config, "moe": _moe_config}
"""A preset's family (stp.costmodel's row name) -> its training config; the
multimodal presets are refused before (shape_of)."""


def _from_json(text: str, seq_len: int, seed: int) -> Any:
    """A config.json's model, as `--init-from` reads it, at this run's seed."""
    import dataclasses

    from stp.models.hf.config import config_from_hf
    from stp.models.hf.moe_config import moe_config_from_hf
    from stp.shapes.moe import HF_MOE_TYPES

    raw = _read_json(text)
    where = str(config_path(text))
    config = (moe_config_from_hf(raw, where) if raw.get("model_type") in HF_MOE_TYPES
              else config_from_hf(raw, where))
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds {where}'s "
                         f"max_position_embeddings={config.max_seq_len}")
    return dataclasses.replace(config, seed=seed)


def check_shape_flags(shape: ModelShape, config: object, text: str) -> None:
    """A model-shape flag (`--layers`, `--hidden`, `--heads`, `--kv-heads`) given with
    `--model` must agree with it (ValueError naming both)."""
    for flag, field in _FLAGS.items():
        given = getattr(shape, flag)
        if given is not None and given != getattr(config, field):
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} {given} contradicts --model {text} ({field}="
                             f"{getattr(config, field)}); drop {name}")
