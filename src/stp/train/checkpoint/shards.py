"""Where a rank's local parameter tensor lies in the full-model tensor.

A TP shard is a box of the global tensor: rows [start, stop) along its shard
dim (stp.models: `ModelStage.shard_slice`), possibly followed by padding rows
that are not part of the model (a vocabulary padded to a multiple of tp). A
replicated parameter (RMSNorm gains) is the whole tensor on every TP rank; a
replicated kv head is the same box on several TP ranks. The checkpoint
stores boxes at their offsets, and the gradient norm counts each distinct box
once (stp.train.checkpoint.sharded, stp.train.step.clip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from stp.runtime.stage_api import (
    TrainableStage,
    full_shape,
    shard_slice,
    ties_head_to_embedding,
)

__all__ = ["Box", "box_of", "norm_key", "BoxSavePlanner", "BoxLoadPlanner"]


@dataclass(frozen=True)
class Box:
    """The real part of a local tensor as a box of the global tensor."""

    size: torch.Size
    """Global shape."""
    offsets: torch.Size
    """Where the local tensor's first element lies in the global tensor."""
    dim: int | None = None
    """The shard dim, when the local tensor may carry padding rows along it."""
    length: int = 0
    """Real rows along `dim` (the rest of the local tensor is padding)."""

    def real(self, local: torch.Tensor) -> torch.Tensor:
        """The part of `local` that belongs to the model (a view)."""
        if self.dim is None or local.shape[self.dim] == self.length:
            return local
        return local.narrow(self.dim, 0, self.length)


def box_of(stage: TrainableStage, name: str, local: torch.Tensor, tp: int, tp_rank: int) -> Box:
    """The box of `local`, this rank's tensor of parameter `name` of `stage`.

    Read from the stage's `shard_slice(name)` and full shape (`specs`) when it
    has them; otherwise the shard dim is cut into tp equal parts."""
    zeros = torch.Size([0] * local.dim())
    where = shard_slice(stage, name)
    dim = where.dim if where is not None else stage.shard_dim(name)
    if dim is None or (where is None and tp == 1):
        return Box(local.size(), zeros)
    if where is None:
        start, length = tp_rank * local.shape[dim], local.shape[dim]
        full = list(local.shape)
        full[dim] *= tp
    else:
        start, length = where.start, where.stop - where.start
        full = list(full_shape(stage, name) or local.shape)
    offsets = list(zeros)
    offsets[dim] = start
    return Box(torch.Size(full), torch.Size(offsets), dim, length)


def norm_key(stage: TrainableStage, name: str, box: Box) -> tuple[str, tuple[int, ...]]:
    """What identifies a gradient for the global norm: equal keys on two ranks hold
    equal gradients, counted once. A tied head (`tie_embeddings`: its gradient is
    summed with the embedding's, so both hold the same) shares the embedding's key."""
    if name == "head.weight" and ties_head_to_embedding(stage):
        name = "embed.weight"
    return name, tuple(box.offsets)


# -- DCP planners: local tensors as boxes of the global tensor --------------------------------


class BoxSavePlanner(DefaultSavePlanner):
    """Writes each tensor of `boxes` as the chunk at its offset of the global tensor
    (DP replicas and TP-replicated tensors write the same chunk; DCP keeps one)."""

    def __init__(self, boxes: dict[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if k not in self.boxes}
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for fqn, box in self.boxes.items():
            t = self.state_dict[fqn]
            chunk = ChunkStorageMetadata(offsets=box.offsets, sizes=t.size())
            items.append(WriteItem(
                index=MetadataIndex(fqn, box.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(t),
                                            box.size),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn]


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads into each tensor of `boxes` the part of the saved global tensor its box
    covers, from whichever saved chunks overlap it (DCP's resharding)."""

    def __init__(self, boxes: dict[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        plain = {k: v for k, v in self.state_dict.items() if k not in self.boxes}
        items = list(create_default_local_load_plan(plain, self.metadata).items)
        for fqn, box in self.boxes.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata), fqn
            if md.size != box.size:
                raise ValueError(f"checkpoint holds {fqn} of shape {tuple(md.size)}, this model "
                                 f"{tuple(box.size)}: it was saved from another model")
            chunk = ChunkStorageMetadata(offsets=box.offsets, sizes=self.state_dict[fqn].size())
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # DCP's default reads these with torch.load(weights_only=False): code could run
        from stp.train.checkpoint.read import safe_load_bytes

        self.state_dict[read_item.dest_index.fqn] = safe_load_bytes(value,
                                                                    read_item.dest_index.fqn)
