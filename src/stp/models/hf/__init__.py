"""Hugging Face Llama and Qwen2 checkpoints in and out (safetensors).

- `load(path, dtype=...)`: a checkpoint directory -> the single-process
  reference model (`.logits(tokens)`, `.loss(tokens, targets)`), for tests,
  evaluation and small jobs.
- `HFCheckpoint.open(path)`: config and tensor headers, checked; its `read`
  is a ShardSource: `build_stage(..., weights=ckpt.read)` loads one stage's TP
  shard by slices (what `Trainer(..., init_from=DIR)` does on every rank).
- `save_stages` (distributed, each pipeline rank writes its own files) and
  `save_state` (one process): a directory transformers loads.
- `config_from_hf` / `config_to_hf`, `hf_name` / `stp_name`: the mappings.

Qwen2-MoE and Mixtral checkpoints (stp.models.moe) go through the same calls:
their config.json gives a MoEConfig (stp.models.hf.moe_config) and their keys
keep transformers' per-expert layout (stp.models.hf.names).
"""

from __future__ import annotations

import os
from dataclasses import fields, replace
from typing import Any

import torch

from stp.models.decoder.reference import ReferenceModel
from stp.models.hf.checkpoint import RUN_FIELDS, TOKENIZER_FILES, HFCheckpoint
from stp.models.hf.config import SUPPORTED_TYPES, config_from_hf, config_to_hf, eos_token_id
from stp.models.hf.formats import format_of
from stp.models.hf.names import hf_name, stp_name
from stp.models.hf.save import DEFAULT_SHARD_BYTES, save_stages, save_state
from stp.shapes.decoder import ModelConfig

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "HFCheckpoint",
    "SUPPORTED_TYPES",
    "TOKENIZER_FILES",
    "agreeing_config",
    "config_from_hf",
    "config_to_hf",
    "eos_token_id",
    "hf_name",
    "load",
    "save_stages",
    "save_state",
    "stp_name",
]



def load(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> ReferenceModel:
    """The checkpoint at `path` as stp's single-process reference model (a MoEReference
    for a Qwen2-MoE or Mixtral checkpoint)."""
    ckpt = HFCheckpoint.open(path)
    reference: ReferenceModel = format_of(ckpt.config).reference(
        ckpt.config, dtype, ckpt.full_tensors(dtype))
    return reference


def agreeing_config(model: Any, ckpt: HFCheckpoint) -> ModelConfig:
    """The config to train `ckpt` with: its own when `model` is None, else `model` if
    it describes the same weights (ValueError naming the first field that differs)."""
    if model is None:
        return ckpt.config
    if not isinstance(model, ModelConfig):
        raise ValueError(f"init_from needs model=None or a ModelConfig, not a "
                         f"{type(model).__name__}")
    keep = {f: getattr(model, f) for f in RUN_FIELDS}
    wanted = replace(ckpt.config, **keep)
    for f in fields(ModelConfig):
        if getattr(model, f.name) != getattr(wanted, f.name):
            raise ValueError(
                f"ModelConfig.{f.name}={getattr(model, f.name)!r} contradicts the checkpoint "
                f"{str(ckpt.path)!r} ({f.name}={getattr(wanted, f.name)!r})"
            )
    return model
