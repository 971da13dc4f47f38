"""From TP shards back to full parameters.

A stage's parameter shard is `tp_slice` of the full tensor (stp.models.decoder.init):
an equal cut, a cut of the padded vocabulary, or, with fewer kv heads than TP
ranks, a whole kv head held by several ranks. `unshard` inverts that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stp.models.decoder.init import ParamSpec, tp_slice
from stp.shapes.decoder import ModelConfig

__all__ = ["ShardSource", "unshard"]

ShardSource = Callable[..., torch.Tensor]
"""`source(config, spec, tp_size, tp_rank, *, device, dtype)` -> this rank's shard of
one parameter (stp.models.init.init_shard, or a checkpoint reader)."""


def unshard(config: ModelConfig, spec: ParamSpec, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every TP rank's shard, in TP rank order."""
    tp = len(parts)
    where = [tp_slice(config, spec, tp, r) for r in range(tp)]
    dim = where[0].dim
    if dim is None:
        return parts[0]
    replicas = config.kv_replicas(tp)
    if spec.tp_split == "kv_heads" and replicas > 1:
        return torch.cat(parts[::replicas], dim=dim)
    kept = [p.narrow(dim, 0, w.stop - w.start) for p, w in zip(parts, where, strict=True)]
    return torch.cat(kept, dim=dim)
