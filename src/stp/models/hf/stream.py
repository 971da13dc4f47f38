"""A safetensors file written one tensor at a time, at known offsets.

`safetensors.torch.save_file` takes every tensor of a file at once. A writer
that joins TP shards would then hold a whole file (up to 5 GB) of full
tensors. Here the header is computed first from the tensors' names, dtypes
and shapes (`header`), the file is created at its final size (`create`), and
each tensor is written at its offset as it arrives (`write_at`): the writer
holds one full tensor at a time.

The format (safetensors' specification): an 8-byte little-endian header length
N, N bytes of JSON {name: {"dtype", "shape", "data_offsets"}, ...,
"__metadata__": {str: str}} padded with spaces, then the tensors' bytes back to
back. No pickle: `safetensors.torch.load_file` reads it.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import torch

__all__ = ["CODES", "Entry", "create", "header", "write_at"]

CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
         torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
         torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
"""torch dtypes and their safetensors codes."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name in the file, dtype and (full) shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


def header(entries: list[Entry], metadata: Mapping[str, str] | None = None
           ) -> tuple[bytes, dict[str, int], int]:
    """(the file's first bytes: length and JSON header; each tensor's offset in the
    file; the file's size). The tensors follow one another in the order given."""
    table: dict[str, Any] = {}
    offsets: dict[str, int] = {}
    pos = 0
    for e in entries:
        if e.dtype not in CODES:
            raise ValueError(f"{e.name}: dtype {e.dtype} has no safetensors code; "
                             f"accepted: {', '.join(str(d) for d in CODES)}")
        table[e.name] = {"dtype": CODES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [pos, pos + e.nbytes]}
        offsets[e.name] = pos
        pos += e.nbytes
    if metadata:
        table["__metadata__"] = dict(metadata)
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads
    start = 8 + len(text)
    return (struct.pack("<Q", len(text)) + text, {n: start + o for n, o in offsets.items()},
            start + pos)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _reserve(fd: int, size: int) -> None:
    """Claim `size` bytes now, so that a full disk fails before any tensor moves
    (where the filesystem cannot, the writes will tell)."""
    if size > 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    os.ftruncate(fd, size)


def create(path: Path, head: bytes, size: int) -> None:
    """File `path` of `size` bytes (reserved on the disk) starting with `head`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _reserve(fd, size)
        _pwrite_all(fd, head, 0)
    finally:
        os.close(fd)


def write_at(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """The bytes of CPU `tensor` at `offset` of open file `fd` (little-endian hosts:
    x86, ARM, as safetensors itself assumes)."""
    _pwrite_all(fd, tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), offset)
