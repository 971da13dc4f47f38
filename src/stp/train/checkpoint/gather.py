"""The whole model gathered on one rank: TP shards joined, pipeline stages merged.

`gather_full_state` is what `Trainer.full_state_dict` returns: every
parameter (or its gradient) under the single-process reference's names, on
global rank 0, on the CPU. Collective: every rank must call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from stp.runtime.mesh import Mesh
from stp.runtime.stage_api import expert_names, unshard

__all__ = ["gather_full_state"]


def _local_full(stages: Mapping[int, Any], mesh: Mesh, collective: Callable[..., Any],
                grads: bool) -> dict[str, torch.Tensor]:
    """This rank's stages' tensors, each TP shard joined with its peers'."""
    local: dict[str, torch.Tensor] = {}
    tp = mesh.dims.tp
    for st in stages.values():
        for name, p in st.named_parameters():
            t = p.grad if grads else p
            t = torch.zeros_like(p) if t is None else t.detach()
            dim = st.shard_dim(name)
            if dim is not None and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                collective("state gather", f"a rank in {mesh.describe_group('tp')}",
                           dist.all_gather, parts, t.contiguous(), group=mesh.tp_group)
                t = unshard(st, name, parts, dim)  # padding, replicated kv heads
            local[name] = t.cpu().clone()
    return local


def gather_full_state(stages: Mapping[int, Any], mesh: Mesh, collective: Callable[..., Any],
                      *, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """Parameters (grads=True: gradients) of the whole model on global rank 0, sorted
    by name; None elsewhere. `collective(action, peers, fn, *args, **kw)` runs a
    collective with errors named (stp.train.step.grad_sync.collective)."""
    local = _local_full(stages, mesh, collective, grads)
    experts = {n for st in stages.values() for n in expert_names(st)}
    payload = {n: t for n, t in local.items()
               if mesh.coord.tp == 0 and mesh.first_replica(n in experts)}
    out: list[Any] | None = [None] * mesh.dims.world_size if mesh.rank == 0 else None
    collective("state gather", "a rank in the world", dist.gather_object, payload, out, dst=0)
    if out is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in out:
        merged.update(part)
    return dict(sorted(merged.items()))
