"""A Hugging Face checkpoint directory, read lazily and by slices.

`HFCheckpoint.open(path)` reads config.json and the safetensors headers only
(names, shapes, dtypes; `model.safetensors.index.json` when the weights are
sharded) and checks them against the config before anything is loaded. A
rank then reads only the slices it owns: `read(config, spec, tp_size,
tp_rank)` has the signature of stp.models.init.init_shard, so
`build_stage(..., weights=checkpoint.read)` materialises one stage's TP shard
straight from the files, never the whole model. Reads go through
stp.models.hf.slices: plain reads of whole rows in blocks into one buffer,
never a mapping of the file, so a rank's peak is its shard plus one block
(1 MB), not plus its largest tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from stp.files import read_json_object
from stp.models.decoder.init import ParamSpec, tp_slice
from stp.models.hf.config import config_from_hf
from stp.models.hf.formats import format_of
from stp.models.hf.moe_config import moe_config_from_hf
from stp.models.hf.names import hf_name, stp_name
from stp.models.hf.slices import StoredTensor, read_header, read_slice
from stp.shapes.decoder import ModelConfig
from stp.shapes.moe import HF_MOE_TYPES

__all__ = ["HFCheckpoint", "RUN_FIELDS", "TOKENIZER_FILES", "same_weights"]

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json")
_IGNORED_KEYS = (".rotary_emb.inv_freq",)  # buffers some old checkpoints stored
RUN_FIELDS = ("max_seq_len", "seed", "init_std")
"""ModelConfig fields that describe a run, not the weights: free to differ from config.json."""


def read_config(raw: dict[str, Any], where: str) -> ModelConfig:
    """The config of a config.json: a MoEConfig for a mixture of experts (qwen2_moe,
    mixtral), else the decoder's ModelConfig (Llama, Qwen2)."""
    if isinstance(raw, dict) and raw.get("model_type") in HF_MOE_TYPES:
        return moe_config_from_hf(raw, where)
    return config_from_hf(raw, where)


def layout_of(config: ModelConfig) -> str:
    """The key layout of `config`'s checkpoint for stp.models.hf.names ("" for a decoder)."""
    return format_of(config).layout(config)


def specs_of(config: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the model `config` describes."""
    return format_of(config).specs(config)


def same_weights(a: ModelConfig, b: ModelConfig) -> bool:
    """Whether two configs describe the same tensors (run fields aside)."""
    return replace(a, **{f: getattr(b, f) for f in RUN_FIELDS}) == b


def _weight_files(path: Path) -> dict[str, StoredTensor]:
    """Hugging Face key -> where its bytes are (every file's header checked)."""
    index = path / INDEX
    if index.is_file():
        weight_map = read_json_object(index, 256 << 20).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(n, str) and n and "/" not in n and "\\" not in n and n[0] != "."
                for n in weight_map.values()):
            raise ValueError(f"{index}: not a safetensors index (weight_map must map tensor "
                             "names to file names in the directory)")
        headers: dict[str, dict[str, StoredTensor]] = {}
        for name in sorted(set(weight_map.values())):
            if not (path / name).is_file():
                raise ValueError(f"{index} names {name}, which is missing from {path}")
            headers[name] = read_header(path / name)
        stored = {}
        for key, name in weight_map.items():
            if key not in headers[name]:
                raise ValueError(f"{index} puts tensor {key} in {name}, which does not hold it")
            stored[key] = headers[name][key]
        return stored
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{path} holds no *.safetensors weights (nor {INDEX})")
    stored = {}
    for f in found:
        stored.update(read_header(f))
    return stored


@dataclass
class HFCheckpoint:
    """A Llama / Qwen2 checkpoint directory: its config and where each tensor is."""

    path: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    stored: dict[str, StoredTensor]

    @property
    def files(self) -> dict[str, Path]:
        """Hugging Face key -> the safetensors file holding it."""
        return {key: t.file for key, t in self.stored.items()}

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
        raw = read_json_object(config_file)  # a list, binary, not JSON: one line
        ckpt = cls(root, raw, read_config(raw, str(config_file)), _weight_files(root))
        ckpt.check_tensors()
        return ckpt

    def expected(self) -> list[ParamSpec]:
        """The specs of every tensor the checkpoint must hold (a tied head is the
        embedding, not stored)."""
        return [s for s in specs_of(self.config) if s.tied_to is None]

    def check_tensors(self) -> None:
        """ValueError unless every expected tensor is there with the config's shape and
        nothing else is (header reads only)."""
        stored = {int(k.split(".")[2]) for k in self.stored
                  if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
        if self.config.num_layers != len(stored):  # before a spec is built per layer
            raise ValueError(f"{self.path}/config.json: num_hidden_layers="
                             f"{self.config.num_layers}, but the weights hold {len(stored)} "
                             "layers")
        layout = layout_of(self.config)
        wanted = {hf_name(s.name, layout): s for s in self.expected()}
        missing = [k for k in wanted if k not in self.stored]
        if missing:
            raise ValueError(f"{self.path}: tensor {missing[0]} is missing (config.json "
                             f"describes {self.config.num_layers} layers)")
        for key, spec in wanted.items():
            shape = self.stored[key].shape
            if shape != spec.shape:
                raise ValueError(f"{self.stored[key].file}: tensor {key} has shape "
                                 f"{list(shape)}, but config.json implies {list(spec.shape)}")
        tied_head = "lm_head.weight" if self.config.tie_embeddings else None
        extra = sorted(k for k in self.stored if k not in wanted and k != tied_head
                       and not k.endswith(_IGNORED_KEYS))
        if extra:
            known = [k for k in extra if stp_name(k, layout) is not None]
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
        key = hf_name(spec.tied_to or spec.name, layout_of(self.config))
        where = tp_slice(config, spec, tp_size, tp_rank)
        return read_slice(self.stored[key], where, dtype, device)

    def full_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every parameter, whole, under stp's names."""
        return {s.name: self.read(self.config, s, dtype=dtype) for s in self.expected()}

    def tokenizer_files(self) -> list[Path]:
        """The tokenizer (and generation config) files next to the weights."""
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]

