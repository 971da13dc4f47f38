"""The whole model as one safetensors file, written stage by stage (`--save-full`).

`Trainer.full_state_dict()` gathers every tensor on global rank 0: at 7B that
alone breaks a run. `write_full` writes the same tensors, under the same names
(the single-process reference's), into one file without any rank ever holding
more than its own shards plus one full tensor:

    1. layout (collective, a few bytes per tensor): TP rank 0 of DP replica 0 of
       every pipeline rank lists its stages' parameters (name, dtype, full
       shape); every rank computes the same safetensors header from the lists:
       names sorted, each tensor's byte range in the file.
    2. global rank 0 writes the header into a temporary file next to PATH and
       reserves the file's whole size (posix_fallocate: a full disk fails here,
       before any tensor moves).
    3. one parameter at a time, DP replica 0 of each pipeline rank gathers the
       TP shards of the tensor to its TP rank 0, which joins them
       (stage.unshard: padding dropped, replicated kv heads taken once) and
       writes the bytes at the tensor's offset (os.pwrite); the pipeline ranks
       write their stages in parallel, into disjoint byte ranges.
    4. the ranks agree that every write succeeded; global rank 0 renames the
       file to PATH (a reader never sees half a file) or removes it.

The file format and the writing at offsets: stp.models.hf.stream. No pickle
anywhere: `safetensors.torch.load_file(PATH)` reads it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stp.models.hf.stream import Entry, create, header, write_at
from stp.runtime.mesh import Mesh
from stp.runtime.stage_api import TrainableStage, expert_names, full_shape, unshard
from stp.train.checkpoint.storage import StorageFault, cause_of

__all__ = ["full_layout", "write_full"]

Collective = Callable[..., Any]
"""`collective(action, peers, fn, *args, **kw)` (stp.train.step.grad_sync.collective)."""


def _full_shape(stage: TrainableStage, name: str, param: torch.Tensor, tp: int) -> tuple[int, ...]:
    dim = stage.shard_dim(name)
    if tp == 1 or dim is None:
        return tuple(param.shape)
    full = full_shape(stage, name)  # a user's stage builder may give none
    if full is not None:
        return full
    return tuple(n * tp if d == dim else n for d, n in enumerate(param.shape))


def _written(stages: Mapping[int, Any], mesh: Mesh) -> list[tuple[Any, str, torch.Tensor]]:
    """(stage, name, parameter) of the parameters this rank's DP replica writes: all of
    them on DP replica 0, and with expert parallelism each EP rank's experts on the
    first replica of its expert-data-parallel group."""
    return [(st, name, p) for st in stages.values() for name, p in st.named_parameters()
            if mesh.first_replica(name in expert_names(st))]


def full_layout(stages: Mapping[int, Any], mesh: Mesh,
                collective: Collective) -> list[Entry]:
    """Every full tensor of the model, sorted by name, on every rank. Collective."""
    mine = [] if mesh.coord.tp else [
        Entry(name, p.dtype, _full_shape(st, name, p, mesh.dims.tp))
        for st, name, p in _written(stages, mesh)]
    everyone: list[Any] = [None] * mesh.dims.world_size
    collective("full-model layout", "a rank in the world", dist.all_gather_object,
               everyone, mine)
    merged = {e.name: e for part in everyone for e in part}
    return [merged[n] for n in sorted(merged)]


def _full_tensor(stage: TrainableStage, name: str, param: torch.Tensor, mesh: Mesh,
                 collective: Collective) -> torch.Tensor | None:
    """The full parameter on TP rank 0, on the CPU (None on the other TP ranks)."""
    t = param.detach().contiguous()
    tp = mesh.dims.tp
    dim = stage.shard_dim(name)
    if tp == 1 or dim is None:
        return t.cpu() if mesh.coord.tp == 0 else None
    parts = [torch.empty_like(t) for _ in range(tp)] if mesh.coord.tp == 0 else None
    collective("full-model write", f"a rank in {mesh.describe_group('tp')}", dist.gather,
               t, parts, dst=mesh.ranks["tp"][0], group=mesh.tp_group)
    if parts is None:
        return None
    return unshard(stage, name, parts, dim).cpu()


def _write_stages(tmp: Path, stages: Mapping[int, Any], mesh: Mesh, collective: Collective,
                  layout: dict[str, Entry], offsets: dict[str, int]) -> str | None:
    """The first replica of each tensor (`_written`) writes it, one at a time; the first failure in
    words (None: none). Every TP rank takes part in every gather, failed or not."""
    fd, error = None, None
    try:
        for st, name, p in _written(stages, mesh):
            full = _full_tensor(st, name, p, mesh, collective)
            if full is None or error is not None:
                continue
            try:
                if full.dtype != layout[name].dtype or tuple(full.shape) != layout[name].shape:
                    raise RuntimeError(f"{name}: joined {full.dtype} {tuple(full.shape)}, "
                                       f"expected {layout[name].dtype} {layout[name].shape}")
                fd = os.open(tmp, os.O_WRONLY) if fd is None else fd
                write_at(fd, full, offsets[name])
            except (OSError, RuntimeError) as e:
                error = cause_of(e)
        if fd is not None and error is None:
            os.fsync(fd)
    except OSError as e:
        error = cause_of(e)
    finally:
        if fd is not None:
            os.close(fd)
    return error


def _agree(mesh: Mesh, collective: Collective, error: str | None, src_only: bool) -> str | None:
    """The first error of any rank (src_only: global rank 0's), on every rank."""
    if src_only:
        box = [error]
        collective("full-model write", "global rank 0", dist.broadcast_object_list, box, src=0)
        return box[0]
    everyone: list[Any] = [None] * mesh.dims.world_size
    collective("full-model write", "a rank in the world", dist.all_gather_object,
               everyone, error)
    return next((e for e in everyone if e), None)


def write_full(path: str | os.PathLike[str], stages: Mapping[int, Any], mesh: Mesh,
               collective: Collective, metadata: Mapping[str, str] | None = None) -> None:
    """Write the model held by `stages` (every rank's, over the mesh) to the safetensors
    file `path` (see the module doc). Collective: every rank calls it; it returns when
    the file is complete. StorageFault, on every rank, when it cannot be written (the
    partial file removed, an earlier file at `path` untouched)."""
    target = Path(path)
    entries = full_layout(stages, mesh, collective)
    head, offsets, size = header(entries, {"format": "pt", **(metadata or {})})
    # rank 0's process id names the temporary file: two runs never write one file
    box: list[Any] = [None]
    if mesh.rank == 0:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            create(tmp, head, size)
            box = [(str(tmp), None)]
        except OSError as e:
            box = [(str(tmp), cause_of(e))]
    collective("full-model write", "global rank 0", dist.broadcast_object_list, box, src=0)
    tmp, error = Path(box[0][0]), box[0][1]
    try:
        if error is None:
            layout = {e.name: e for e in entries}
            error = _agree(mesh, collective,
                           _write_stages(tmp, stages, mesh, collective, layout, offsets),
                           src_only=False)
        if mesh.rank == 0 and error is None:
            try:
                os.replace(tmp, target)
            except OSError as e:
                error = cause_of(e)
        error = _agree(mesh, collective, error, src_only=True)
    finally:
        if mesh.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    if error is not None:
        raise StorageFault(f"cannot write {target}: {error}; the partial file was removed")
