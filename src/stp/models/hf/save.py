"""Writing a model as a Hugging Face checkpoint directory transformers loads with
`AutoModelForCausalLM.from_pretrained`: config.json, safetensors files of at
most `max_shard_bytes` each (`model.safetensors` when one is enough, else
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`), and
the tokenizer and generation files of the source checkpoint when it had any.

`save_stages` is the distributed writer: every pipeline rank writes the files
of its own stages (its TP group gathers each tensor to TP rank 0, one tensor
at a time, and its first DP replica writes it at its offset in the file,
stp.models.hf.stream), so no rank ever holds more than its stages' share of
the model plus one full tensor; global rank 0 writes the index and
config.json. `save_state` writes a whole state dict from one process.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from stp.models.hf.checkpoint import INDEX, HFCheckpoint, layout_of
from stp.models.hf.config import config_to_hf
from stp.models.hf.moe_config import moe_config_to_hf
from stp.models.hf.names import hf_name
from stp.models.hf.stream import Entry as Tensor
from stp.models.hf.stream import create, header, write_at
from stp.runtime.stage_api import expert_names
from stp.shapes.decoder import ModelConfig
from stp.shapes.moe import MoEConfig

__all__ = ["DEFAULT_SHARD_BYTES", "save_state", "save_stages"]

DEFAULT_SHARD_BYTES = 5 * 10**9
"""transformers' own default largest file ("5GB")."""

Entry = tuple[str, str, int]
"""(stp name, Hugging Face key, bytes)."""


def _chunk(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive entries packed into files of at most max_bytes (a larger tensor
    gets a file of its own)."""
    files: list[list[Entry]] = []
    size = 0
    for entry in entries:
        if not files or (size + entry[2] > max_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry[2]
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def _prepare_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"save directory {str(out)!r} is a file")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:
        stale.unlink(missing_ok=True)


def _write_metadata(
    out: Path, files: list[list[Entry]], config: ModelConfig, dtype: torch.dtype,
    source: HFCheckpoint | None,
) -> None:
    names = _file_names(len(files))
    if len(files) > 1:
        weight_map = {key: name for name, group in zip(names, files, strict=True)
                      for _, key, _ in group}
        total = sum(e[2] for group in files for e in group)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    dtype_name = str(dtype).removeprefix("torch.")
    base = None if source is None else source.raw_config
    if isinstance(config, MoEConfig):
        raw = moe_config_to_hf(config, dtype_name, base)
    else:
        raw = config_to_hf(config, dtype_name, base)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    for f in [] if source is None else source.tokenizer_files():
        shutil.copyfile(f, out / f.name)


def _entries(named: list[tuple[str, torch.Tensor]], shapes: Mapping[str, tuple[int, ...]],
             tied: set[str], layout: str = "") -> list[Entry]:
    out = []
    for name, t in named:
        if name in tied:
            continue
        numel = 1
        for d in shapes[name]:
            numel *= d
        out.append((name, hf_name(name, layout), numel * t.element_size()))
    return out


def save_state(
    out_dir: str | Path,
    state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    *,
    source: HFCheckpoint | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write full tensors under stp's names (e.g. Trainer.full_state_dict()) from one
    process. A tied head is not written (transformers ties it to the embedding)."""
    out = Path(out_dir)
    _prepare_dir(out)
    tied = {"head.weight"} if config.tie_embeddings else set()
    named = list(state.items())
    files = _chunk(_entries(named, {n: tuple(t.shape) for n, t in named}, tied,
                            layout_of(config)), max_shard_bytes)
    for name, group in zip(_file_names(len(files)), files, strict=True):
        tensors = {key: state[n].detach().cpu().contiguous() for n, key, _ in group}
        save_file(tensors, out / name, metadata={"format": "pt"})
    dtype = next(iter(state.values())).dtype
    _write_metadata(out, files, config, dtype, source)


def _gather_full(stage: Any, name: str, param: torch.Tensor, mesh: Any) -> torch.Tensor | None:
    """The full tensor on TP rank 0 (None on the other TP ranks)."""
    t = param.detach().contiguous()
    tp = mesh.dims.tp
    if tp == 1 or stage.shard_dim(name) is None:
        return t.cpu() if mesh.coord.tp == 0 else None
    parts = [torch.empty_like(t) for _ in range(tp)] if mesh.coord.tp == 0 else None
    dist.gather(t, parts, dst=mesh.ranks["tp"][0], group=mesh.tp_group)
    return None if parts is None else stage.unshard(name, parts).cpu()


def _stream_file(path: Path, group: list[Entry], stage_of: Mapping[str, Any],
                 params: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]],
                 mesh: Any, error: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One file of this rank's stages, written by TP rank 0 one tensor at a time as its
    TP group joins them (stp.models.hf.stream): the writer holds one full tensor, not
    the file's. Every TP rank takes part in every gather, whatever failed; returns the
    first failure as OSError arguments (None: none)."""
    fd = None
    if mesh.coord.tp == 0 and error is None:
        entries = [Tensor(key, params[n].dtype, tuple(shapes[n])) for n, key, _ in group]
        head, offsets, size = header(entries, {"format": "pt"})
        try:
            create(path, head, size)
            fd = os.open(path, os.O_WRONLY)
        except OSError as e:
            error = (e.errno, e.strerror, str(path))
    try:
        for n, key, _ in group:
            full = _gather_full(stage_of[n], n, params[n], mesh)
            if full is not None and fd is not None and error is None:
                try:
                    write_at(fd, full, offsets[key])
                except OSError as e:
                    error = (e.errno, e.strerror, str(path))
    finally:
        if fd is not None:
            os.close(fd)
    return error


def save_stages(
    out_dir: str | Path,
    stages: Mapping[int, Any],
    mesh: Any,
    config: ModelConfig,
    *,
    source: HFCheckpoint | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write the model held by `stages` (this rank's ModelStages; `mesh`: the
    stp.runtime.mesh.Mesh) as a Hugging Face checkpoint. Collective: every rank
    of the world calls it; it returns when the directory is complete."""
    out = Path(out_dir)
    c = mesh.coord
    # the first DP replica of each tensor writes it (an EP rank's experts: the first
    # replica of its expert-data-parallel group)
    named = [(n, p) for s in sorted(stages) for n, p in stages[s].named_parameters()
             if mesh.first_replica(n in expert_names(stages[s]))]
    shapes = {n: stages[s].specs[n].shape for s in stages for n in stages[s].specs}
    tied = {"head.weight"} if config.tie_embeddings else set()
    mine = _chunk(_entries(named, shapes, tied, layout_of(config)), max_shard_bytes)
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, mine if c.tp == 0 else [])
    files = [group for plan in plans for group in plan]
    # the files' numbers of this TP group's writer (its TP rank 0), for all its TP ranks
    offset = sum(len(plan) for plan in plans[: mesh.ranks["tp"][0]])
    names = _file_names(len(files))
    if mesh.rank == 0:
        _prepare_dir(out)
    dist.barrier()
    params = dict(named)
    stage_of = {n: stages[s] for s in stages for n in stages[s].specs}
    error = None
    for k, group in enumerate(mine):
        error = _stream_file(out / names[offset + k], group, stage_of, params, shapes, mesh,
                             error)
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # a full disk on one rank stops every rank
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise OSError(*first)
    if mesh.rank == 0:
        _write_metadata(out, files, config, named[0][1].dtype, source)
    dist.barrier()
