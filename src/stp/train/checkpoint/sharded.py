"""Sharded checkpoints that resume exactly, on the same mesh or on another one.

Written with torch.distributed.checkpoint (DCP): every rank writes its own
file in parallel, the coordinator writes the index (`.metadata`: every key's
global shape and which chunk lies where). One checkpoint is a directory
`step-00000042` holding:

    __<r>_0.distcp         rank r's data (DCP)
    .metadata              DCP's index
    stp.json               step, mesh, schedule, dtype, model shape (read before launch)

Keys, every parameter under its full-model name with its global shape:

    model/<name>           the model's parameter (its own dtype)
    master/<name>          the fp32 master weight (mixed precision only)
    optim/<name>/<state>   optimizer state: tensors shaped like the parameter are
                           sharded as it is, scalars (AdamW's step) replicated

With the sharded optimizer (stp.train.step.zero) `master/` and `optim/` tensors are
each rank's rows of its TP box: one more box of the full-model tensor, so a
checkpoint saved sharded loads unsharded, on another dp, and the other way.
    optim/<name>/hparams   hyperparameters of the parameter's group (lr, betas, ...)
    scheduler, trainer     LR scheduler state; step and data position
    rng/rank<r>            RNG state of global rank r (restored where that rank exists)

Why plain tensors with chunk metadata, not DTensor or ShardedTensor: the
model does not use DTensor, and wrapping each shard in one would need a
DeviceMesh whose groups duplicate the stp mesh's; ShardedTensor is deprecated
and building one is a collective per tensor. A TP shard is a box of the
global tensor at a known offset, which is exactly what DCP's index stores, so
the save planner (stp.train.checkpoint.shards) writes each local tensor as the chunk at
its offset (DP replicas and TP-replicated tensors write the same chunk; DCP
keeps one, spreading the writes over the ranks), and the load planner asks
DCP for the box this rank now holds (`create_read_items_for_chunk_list`, the
resharding DTensor itself goes through). Only DCP's public planner API is
used, the same on gloo and NCCL: a checkpoint of pp2 x tp2 loads on pp4 and
on one process (tests/train/test_checkpoint.py), or any other mesh.

Atomic: ranks write into `.step-00000042.partial`; after DCP wrote the index
(all data files are complete by then) global rank 0 renames it. A run
killed while saving leaves only a `.partial`, which `latest` ignores. The
directory must be shared by all ranks (one node, or a shared filesystem).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from stp.train.checkpoint import integrity, storage
from stp.train.checkpoint.read import SafeReader
from stp.train.checkpoint.shards import Box, BoxLoadPlanner, BoxSavePlanner, box_of
from stp.train.step import finite

if TYPE_CHECKING:  # the pre-launch checks (stp.train.run.job) import this module: keep them
    # from importing the executor and the models behind the Parts, which they never use
    from stp.train.run.parts import Parts

__all__ = ["checkpoint_name", "complete_checkpoints", "latest", "read_info", "save", "load"]

PREFIX = "step-"
INFO = "stp.json"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / INFO).is_file()


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints directly under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit() and _is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(path: str | Path) -> Path:
    """`path` itself if it is a complete checkpoint, else the newest complete one
    in it. ValueError naming the path when there is none."""
    p = Path(path)
    if _is_complete(p):
        return p
    found = complete_checkpoints(p)
    if not found:
        what = "does not exist" if not p.exists() else "holds no complete checkpoint"
        raise ValueError(f"resume path {str(path)!r} {what}: give a checkpoint directory "
                         f"({PREFIX}N with .metadata and {INFO}) or the directory holding them")
    return found[-1]


def read_info(path: str | Path) -> dict[str, Any]:
    """The checkpoint's stp.json: step, mesh, schedule, dtype, model (ValueError naming
    the file when it is not a JSON object)."""
    from stp.files import read_json_object

    return read_json_object(Path(path) / INFO)


# -- what a trainer holds: its built parts, optimizer, LR scheduler and step count ---------

Scheduler = torch.optim.lr_scheduler.LRScheduler


Param = tuple[str, torch.nn.Parameter, torch.nn.Parameter, Box, Box]


def _params(parts: Parts) -> list[Param]:
    """(name, model parameter, optimizer parameter, the model parameter's box, the
    optimizer parameter's box) once per name; the two boxes differ when the
    optimizer is sharded (stp.train.step.zero: a row box inside the model's)."""
    stage_of = {name: st for st in parts.stages.values() for name, _ in st.named_parameters()}
    tp, tp_rank = parts.dims.tp, parts.mesh.coord.tp
    out, seen = [], set()
    prec = parts.precision
    for i, (name, model, opt) in enumerate(zip(prec.names, prec.model, prec.params,
                                               strict=True)):
        if name not in seen:
            seen.add(name)
            box = box_of(stage_of[name], name, model, tp, tp_rank)
            out.append((name, model, opt, box, prec.optimizer_box(i, box)))
    return out


def _holds_rows(opt: torch.Tensor, box: Box) -> bool:
    """Does the optimizer parameter hold any element of the model? (A DP shard may
    hold no rows, or only padding rows: it writes and reads nothing.)"""
    return box.real(opt).numel() > 0


def _hparams(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """id(parameter) -> its group's hyperparameters (everything but the params)."""
    return {id(p): {k: v for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups for p in g["params"]}


def _save_state(parts: Parts, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None,
                steps_done: int) -> tuple[dict[str, Any], dict[str, Box]]:
    state: dict[str, Any] = {}
    boxes: dict[str, Box] = {}
    hparams = _hparams(optimizer)
    for name, model, opt, box, obox in _params(parts):
        state[f"model/{name}"], boxes[f"model/{name}"] = box.real(model.detach()), box
        holds = _holds_rows(opt, obox)
        if parts.precision.mixed and holds:
            state[f"master/{name}"], boxes[f"master/{name}"] = obox.real(opt.detach()), obox
        for key, value in optimizer.state.get(opt, {}).items():
            fqn = f"optim/{name}/{key}"
            if isinstance(value, torch.Tensor) and value.size() == opt.size():
                if holds:
                    state[fqn], boxes[fqn] = obox.real(value), obox
            else:
                state[fqn] = value
        state[f"optim/{name}/hparams"] = hparams[id(opt)]
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["trainer"] = {"step": steps_done, "data_position": steps_done}
    state[f"rng/rank{parts.mesh.rank}"] = _rng_state()
    return state, boxes


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _info(parts: Parts, steps_done: int) -> dict[str, Any]:
    config, d = parts.model_config, parts.dims
    return {
        "step": steps_done, "pp": d.pp, "tp": d.tp, "dp": d.dp,
        "schedule": parts.schedule.name,
        "dtype": str(parts.options.dtype).removeprefix("torch."),
        "model": None if config is None else dataclasses.asdict(config),
    }


# -- save -----------------------------------------------------------------------------------


def _publish(tmp: Path, final: Path, keep: int | None) -> None:
    """Rank 0: move the finished checkpoint to its name, drop the oldest beyond `keep`."""
    if final.exists():  # re-saving a step (a resumed run): replace the old one
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    if keep is not None:
        for stale in complete_checkpoints(final.parent)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)


def _agree(rank: int, error: str | None) -> None:
    """Rank 0's error (or None) on every rank; raise it everywhere (a StorageFault:
    every rank has the same, rank 0 reports it)."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise storage.StorageFault(box[0])


def save(parts: Parts, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None,
         steps_done: int, directory: str | Path, *, keep: int | None = None) -> Path:
    """Write the checkpoint of a trainer (its built `parts`, `optimizer`, LR
    `scheduler`, after `steps_done` steps) as `directory/step-<steps_done>` and
    return its path. Collective: every rank calls it with the same directory.
    `keep`: keep only that many newest checkpoints in `directory`."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (or None: keep all), got {keep}")
    root = Path(directory)
    final = root / checkpoint_name(steps_done)
    tmp = root / f".{final.name}.partial"
    rank = dist.get_rank()
    # a non-finite model is never written: it would rotate good checkpoints out
    finite.require_finite(parts.named_parameters(), f"checkpoint {final} not written "
                          "(the earlier ones are kept)")
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            # left by a run killed while saving: no live run owns it (stp.train.run.outlock)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            error = f"cannot write checkpoint directory {str(root)!r}: {e}"
    _agree(rank, error)
    state, boxes = _save_state(parts, optimizer, scheduler, steps_done)
    storage.space_check(root, state, rank)  # a full disk refused before a byte is written
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=BoxSavePlanner(boxes))
    except CheckpointException as e:  # a BaseException: one line, the partial removed
        raise storage.save_failure(e, tmp, final, rank) from None
    digests = integrity.shard_digests(tmp)  # each rank hashes its own files
    if rank == 0:
        try:
            (tmp / INFO).write_text(json.dumps(_info(parts, steps_done), indent=1) + "\n")
            integrity.write_manifest(tmp, digests)  # verified before a resume loads
            _publish(tmp, final, keep)
        except OSError as e:
            error = str(storage.save_failure(e, tmp, final, rank))
    _agree(rank, error)
    return final


# -- load -----------------------------------------------------------------------------------


def _optim_keys(keys: Any) -> dict[str, list[str]]:
    """Parameter name -> its `optim/<name>/<state>` keys in the checkpoint."""
    out: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith("optim/"):
            _, name, _ = key.split("/", 2)
            out.setdefault(name, []).append(key)
    return out


def _state_target(md: Any, opt: torch.Tensor, box: Box) -> tuple[Any, Any]:
    """(the whole local tensor to keep, the part to load into) for optimizer state
    `md`; padding rows stay zero. Objects: (None, None), DCP puts the value in."""
    if not isinstance(md, TensorStorageMetadata):
        return None, None
    if md.size == box.size:
        whole = torch.zeros_like(opt, memory_format=torch.contiguous_format)
        return whole, box.real(whole)
    whole = torch.zeros(md.size, dtype=md.properties.dtype)
    return whole, whole


def _load_state(
    parts: Parts, keys: Any, where: str
) -> tuple[dict[str, Any], dict[str, Box], dict[str, torch.Tensor]]:
    """(what DCP loads into, the boxes, optimizer state key -> whole local tensor)."""
    optim = _optim_keys(keys)
    state: dict[str, Any] = {}
    boxes: dict[str, Box] = {}
    wholes: dict[str, torch.Tensor] = {}
    for name, _, opt, _, box in _params(parts):
        key = f"master/{name}" if f"master/{name}" in keys else f"model/{name}"
        if key not in keys:
            raise ValueError(f"checkpoint {where} has no parameter {name!r}: it was saved from "
                             "another model")
        holds = _holds_rows(opt, box)
        if holds:
            state[key], boxes[key] = box.real(opt.detach()), box
        for fqn in optim.get(name, []):
            whole, target = _state_target(keys[fqn], opt, box)
            if whole is not None:
                wholes[fqn] = whole
                if keys[fqn].size == box.size:
                    if not holds:
                        continue  # an empty shard: its zero-row state is `whole`
                    boxes[fqn] = box
            state[fqn] = target
    for key in ("scheduler", "trainer", f"rng/rank{parts.mesh.rank}"):
        if key in keys:
            state[key] = None
    return state, boxes, wholes


def _apply_optimizer_state(parts: Parts, optimizer: torch.optim.Optimizer,
                           state: dict[str, Any]) -> None:
    opt_state = optimizer.state
    hparams: dict[int, dict[str, Any]] = {}
    for name, _, opt, _, _ in _params(parts):
        prefix = f"optim/{name}/"
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if "hparams" in mine:
            hparams[id(opt)] = mine.pop("hparams")
        if mine:
            opt_state[opt] = {k: v.to(opt.device) if isinstance(v, torch.Tensor) and v.dim()
                              else v for k, v in mine.items()}
    for group in optimizer.param_groups:
        saved = next((hparams[id(p)] for p in group["params"] if id(p) in hparams), None)
        if saved is not None:
            group.update(saved)


def load(parts: Parts, optimizer: torch.optim.Optimizer, scheduler: Scheduler | None,
         path: str | Path, *, allow_unverified: bool = False) -> int:
    """Load checkpoint `path` (a `step-N` directory) into a trainer's built `parts`,
    `optimizer` and LR `scheduler`, whatever mesh and schedule wrote it; returns
    the steps done when it was saved, where the trainer goes on. A checkpoint without
    its manifest is refused unless `allow_unverified` (stp.train.checkpoint.integrity).
    Collective."""
    path = Path(path)
    # rank 0 checks the files before any rank reads
    integrity.verify_everywhere(path, allow_unverified=allow_unverified)
    reader = SafeReader(path)  # never plain pickle: stp.train.checkpoint.read
    keys = reader.read_metadata().state_dict_metadata
    state, boxes, wholes = _load_state(parts, keys, repr(str(path)))
    try:
        dcp.load(state, storage_reader=reader, planner=BoxLoadPlanner(boxes))
    except CheckpointException as e:  # a BaseException: one line naming the checkpoint
        raise storage.load_failure(e, path) from None
    _apply_optimizer_state(parts, optimizer, {**state, **wholes})
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = state.get(f"rng/rank{parts.mesh.rank}")
    if rng is not None:
        _set_rng_state(rng)
    parts.precision.copy_to_model()
    finite.require_finite(parts.named_parameters(), f"checkpoint {path} refused: resuming "
                          "would train nothing")
    if state.get("trainer") is not None:
        return int(state["trainer"]["step"])
    return int(read_info(path)["step"])
