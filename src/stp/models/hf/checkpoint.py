"""A Hugging Face checkpoint directory, read lazily and by slices.

`HFCheckpoint.open(path)` reads config.json and the safetensors headers only
(names, shapes, dtypes; `model.safetensors.index.json` when the weights are
sharded) and checks them against the config before anything is loaded. A
rank then reads only the slices it owns: `read(config, spec, tp_size,
tp_rank)` has the signature of stp.models.init.init_shard, so
`build_stage(..., weights=checkpoint.read)` materialises one stage's TP shard
straight from the files, never the whole model: safetensors' `get_slice`
maps the file and touches only the requested rows (or, for a column slice,
the pages holding them). Its result may be a view of that mapping (two reads
of one tensor share memory), so each read copies it into memory of its own
and unmaps the file before the next: a rank's peak is its shard plus one
tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stp.models.decoder.init import ParamSpec, pad_shard, parameter_specs, tp_slice
from stp.models.hf.config import config_from_hf
from stp.models.hf.names import hf_name, stp_name
from stp.shapes.decoder import ModelConfig

__all__ = ["HFCheckpoint", "RUN_FIELDS", "TOKENIZER_FILES", "same_weights"]

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json")
_IGNORED_KEYS = (".rotary_emb.inv_freq",)  # buffers some old checkpoints stored
RUN_FIELDS = ("max_seq_len", "seed", "init_std")
"""ModelConfig fields that describe a run, not the weights: free to differ from config.json."""


def same_weights(a: ModelConfig, b: ModelConfig) -> bool:
    """Whether two configs describe the same tensors (run fields aside)."""
    return replace(a, **{f: getattr(b, f) for f in RUN_FIELDS}) == b


def _weight_files(path: Path) -> dict[str, Path]:
    """Hugging Face key -> the safetensors file holding it."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        files = {key: path / name for key, name in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ValueError(f"{index} names {f.name}, which is missing from {path}")
        return files
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{path} holds no *.safetensors weights (nor {INDEX})")
    files: dict[str, Path] = {}
    for f in found:
        with safe_open(f, "pt") as handle:
            files.update((key, f) for key in handle.keys())  # noqa: SIM118 (not a dict)
    return files


@dataclass
class HFCheckpoint:
    """A Llama / Qwen2 checkpoint directory: its config and where each tensor is."""

    path: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    files: dict[str, Path]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> HFCheckpoint:
        """Read config.json and the tensor headers; ValueError naming the path or field
        for a missing directory, an unsupported config, missing or misshapen tensors."""
        root = Path(path)
        if not root.is_dir():
            raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
        config_file = root / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file} is missing: a Hugging Face checkpoint directory "
                             "holds config.json and *.safetensors")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}: not JSON ({e})") from None
        ckpt = cls(root, raw, config_from_hf(raw, str(config_file)), _weight_files(root))
        ckpt.check_tensors()
        return ckpt

    def expected(self) -> list[ParamSpec]:
        """The specs of every tensor the checkpoint must hold (a tied head is the
        embedding, not stored)."""
        return [s for s in parameter_specs(self.config) if s.tied_to is None]

    def check_tensors(self) -> None:
        """ValueError unless every expected tensor is there with the config's shape and
        nothing else is (header reads only)."""
        wanted = {hf_name(s.name): s for s in self.expected()}
        missing = [k for k in wanted if k not in self.files]
        if missing:
            raise ValueError(f"{self.path}: tensor {missing[0]} is missing (config.json "
                             f"describes {self.config.num_layers} layers)")
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted({self.files[k] for k in wanted}):
            with safe_open(file, "pt") as handle:
                shapes.update((k, tuple(handle.get_slice(k).get_shape()))
                              for k in wanted if self.files[k] == file)
        for key, spec in wanted.items():
            shape = shapes[key]
            if shape != spec.shape:
                raise ValueError(f"{self.files[key]}: tensor {key} has shape {list(shape)}, but "
                                 f"config.json implies {list(spec.shape)}")
        tied_head = "lm_head.weight" if self.config.tie_embeddings else None
        extra = sorted(k for k in self.files if k not in wanted and k != tied_head
                       and not k.endswith(_IGNORED_KEYS))
        if extra:
            known = [k for k in extra if stp_name(k) is not None]
            raise ValueError(f"{self.path}: tensors config.json does not describe: "
                             f"{', '.join((known or extra)[:4])}"
                             + (f" and {len(extra) - 4} more" if len(extra) > 4 else ""))

    def read(
        self,
        config: ModelConfig,
        spec: ParamSpec,
        tp_size: int = 1,
        tp_rank: int = 0,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """TP rank tp_rank's shard of `spec`, read by slice from its file (a ShardSource)."""
        if not same_weights(config, self.config):
            raise ValueError(f"HFCheckpoint.read: the config describes other tensors than "
                             f"{self.path}/config.json")
        key = hf_name(spec.tied_to or spec.name)
        where = tp_slice(config, spec, tp_size, tp_rank)
        with safe_open(self.files[key], "pt") as handle:
            part = handle.get_slice(key)
            if where.dim is None:
                t = part[:]
            elif where.dim == 0:
                t = part[where.start : where.stop]
            else:
                t = part[:, where.start : where.stop]
            t = t.to(dtype=dtype, copy=True)  # not a view of the file's mapping
        return pad_shard(t, where).contiguous().to(device)

    def full_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every parameter, whole, under stp's names."""
        return {s.name: self.read(self.config, s, dtype=dtype) for s in self.expected()}

    def tokenizer_files(self) -> list[Path]:
        """The tokenizer (and generation config) files next to the weights."""
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]
