"""The sharded optimizer's rank-major layout (stp.train.step.zero's module doc draws it):
how each parameter's rows are cut over the DP ranks (`RowSplit`), where each
chunk lies in the flat buffers a reduce-scatter reads and an all-gather fills
(`ShardLayout`: pack, add, unpack), and the checkpoint box of a chunk
(`row_box`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from stp.train.checkpoint.shards import Box

__all__ = ["RowSplit", "ShardLayout", "row_box"]


@dataclass(frozen=True)
class RowSplit:
    """How one parameter's rows are cut over the DP ranks."""

    rows: int
    """Rows of the local tensor (dim 0)."""
    width: int
    """Elements per row."""
    chunk: int
    """Rows per rank, ceil(rows / dp); the last ranks' chunks are short or empty."""
    offset: int
    """Where the chunk lies in each rank's segment of the flat buffers."""

    def rows_of(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the rows `rank` holds (start == stop: none)."""
        start = min(rank * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows)

    @property
    def size(self) -> int:
        """Elements of one chunk in the flat buffers (padding included)."""
        return self.chunk * self.width


class ShardLayout:
    """The rank-major flat layout of a list of parameter shapes (module doc)."""

    def __init__(self, shapes: Sequence[torch.Size], size: int) -> None:
        self.size = size
        self.splits: list[RowSplit] = []
        offset = 0
        for shape in shapes:
            rows = shape[0]
            width = math.prod(shape[1:])
            split = RowSplit(rows, width, -(-rows // size), offset)
            self.splits.append(split)
            offset += split.size
        self.segment = offset
        """S: elements of one rank's segment."""

    def _chunks(self, flat: torch.Tensor, split: RowSplit) -> torch.Tensor:
        """Every rank's chunk of one parameter in `flat`, as [dp, chunk, width]."""
        ranks = flat.view(self.size, self.segment)
        return ranks[:, split.offset : split.offset + split.size].view(
            self.size, split.chunk, split.width)

    def _rows_as_chunks(self, split: RowSplit, t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """`t` (a whole parameter) as rows, and how many whole chunks and tail rows its
        rows fill."""
        full, tail = divmod(split.rows, split.chunk)
        return t.reshape(split.rows, split.width), full, tail

    def pack(self, tensors: Iterable[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy whole parameters into `flat` (dp x S), rank-major; padding rows zero."""
        for t, split in zip(tensors, self.splits, strict=True):
            if split.chunk == 0:
                continue
            dst = self._chunks(flat, split)
            src, full, tail = self._rows_as_chunks(split, t)
            dst[:full].copy_(src[: full * split.chunk].view(full, split.chunk, split.width))
            if full < self.size:
                dst[full, :tail].copy_(src[full * split.chunk :])
                dst[full, tail:].zero_()
                dst[full + 1 :].zero_()

    def add(self, flat: torch.Tensor, j: int, t: torch.Tensor) -> None:
        """Add whole parameter `t` (the j-th of the layout) to its chunks in `flat`
        (dp x S), as `pack` would place it: a gradient summed straight into the
        packed buffer its reduce-scatter reads (padding rows untouched)."""
        split = self.splits[j]
        if split.chunk == 0:
            return
        dst = self._chunks(flat, split)
        src, full, tail = self._rows_as_chunks(split, t)
        dst[:full].add_(src[: full * split.chunk].view(full, split.chunk, split.width))
        if tail:
            dst[full, :tail].add_(src[full * split.chunk :])

    def unpack(self, flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
        """Copy every rank's chunks in `flat` (dp x S) back into whole parameters."""
        for j, t in enumerate(tensors):
            self.unpack_one(flat, j, t)

    def unpack_one(self, flat: torch.Tensor, j: int, t: torch.Tensor) -> None:
        """Copy the j-th parameter's chunks in `flat` (dp x S) into whole `t`."""
        split = self.splits[j]
        if split.chunk == 0:
            return
        src = self._chunks(flat, split)
        dst, full, tail = self._rows_as_chunks(split, t)
        dst[: full * split.chunk].view(full, split.chunk, split.width).copy_(src[:full])
        if tail:
            dst[full * split.chunk :].copy_(src[full, :tail])

    def local(self, flat: torch.Tensor, i: int, rank: int, shape: torch.Size) -> torch.Tensor:
        """Parameter i's real rows held by `rank` in that rank's segment `flat` (S), as
        a view shaped like the parameter's rows."""
        split = self.splits[i]
        start, stop = split.rows_of(rank)
        part = flat[split.offset : split.offset + (stop - start) * split.width]
        return part.view(stop - start, *shape[1:])


def row_box(box: Box, start: int, stop: int) -> Box:
    """The box of rows [start, stop) of a local tensor whose box is `box`: the rows
    lie at `start` past its offset along dim 0; when its TP shard dim is 0, rows
    past its real length are padding (a vocabulary padded to a multiple of tp)."""
    offsets = list(box.offsets)
    offsets[0] += start
    if box.dim == 0:
        real = max(0, min(stop, box.length) - start)
        return Box(box.size, torch.Size(offsets), 0, real)
    return Box(box.size, torch.Size(offsets), box.dim, box.length)
