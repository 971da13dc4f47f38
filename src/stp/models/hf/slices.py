"""One TP rank's slice of a safetensors tensor, read with plain file reads in blocks.

A safetensors file is an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range) and the tensors' bytes, row-major
and little-endian. Mapping the file (what `safetensors.safe_open` does) makes
every page a slice touches resident in the process until the mapping closes,
so loading a tensor briefly holds its mapped pages beside the copy: a rank's
peak was its shard plus its largest tensor (at tp1, a 128k-vocabulary
embedding: gigabytes). Reading instead copies `BLOCK_BYTES` of whole rows at a
time into one reusable buffer and from there into the rank's tensor (casting
and dropping the columns it does not own on the way), so the peak is the shard
plus one block, whatever the tensor's size. Each block is checked for NaN and
inf as it arrives.

The header is hostile until checked: `read_header` refuses a length beyond
the file or `MAX_HEADER_BYTES`, byte ranges outside the data, a dtype outside
`DTYPES`, and a shape whose size disagrees with its byte range (a read never
strays into another tensor's bytes or past the end of the file).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stp.models.decoder.init import ShardSlice

__all__ = ["BLOCK_BYTES", "DTYPES", "MAX_HEADER_BYTES", "NotFinite", "StoredTensor",
           "read_header", "read_slice", "scan_finite"]

MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header (its tensor names, shapes and offsets)."""

BLOCK_BYTES = 1 << 20
"""Bytes of whole rows read at a time when a read casts or keeps some columns: the
transient a read adds to the rank's shard (a row longer than this is read whole)."""

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""The safetensors dtypes stp reads. Quantised formats (F8_*) are refused: cast to
the training dtype without their scales they would load silently wrong."""


class NotFinite(ValueError):
    """A stored tensor holds NaN or inf."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: `file` from byte `start`, `dtype`, `shape`."""

    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int


def _bad(file: Path, why: str) -> ValueError:
    return ValueError(f"{file}: not a complete safetensors file ({why})")


def _read_raw_header(file: Path) -> tuple[int, Any, int]:
    """(header length, parsed header, file size); the length checked before the read."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _bad(file, f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise _bad(file, f"its header claims {n} bytes, the file holds {size}")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _bad(file, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(file, "its header is not a JSON object")
    return n, header, size


def _offsets(file: Path, name: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _bad(file, f"tensor {name!r} has no valid data_offsets")
    return offsets[0], offsets[1]


def _stored(file: Path, name: str, entry: dict[str, Any], data_start: int,
            span: tuple[int, int]) -> StoredTensor:
    """The tensor `name`, its dtype and shape checked against its byte range."""
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if dtype not in DTYPES:
        raise ValueError(f"{file}: tensor {name!r} has dtype {dtype!r}; stp reads "
                         f"{', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _bad(file, f"tensor {name!r} has no valid shape")
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if need != span[1] - span[0]:
        raise _bad(file, f"tensor {name!r} of shape {shape} in {dtype} needs {need} bytes, "
                         f"its data_offsets give {span[1] - span[0]}")
    return StoredTensor(file, name, dtype, tuple(shape), data_start + span[0])


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of `file` and where its bytes are; ValueError naming `file` unless
    the header is complete, every tensor's bytes lie inside the data and agree with
    its shape and dtype, and the data ends where the file does (a truncated file is
    refused here, before anything is read)."""
    n, header, size = _read_raw_header(file)
    spans = {name: _offsets(file, name, entry) for name, entry in header.items()
             if name != "__metadata__"}
    end = max((stop for _, stop in spans.values()), default=0)
    if 8 + n + end != size:
        raise _bad(file, f"its tensors need {8 + n + end} bytes, the file holds {size}: "
                         "truncated or damaged")
    return {name: _stored(file, name, header[name], 8 + n, span) for name, span in spans.items()}


def _shard_shape(shape: tuple[int, ...], where: ShardSlice) -> list[int]:
    out = list(shape)
    if where.dim is not None:
        out[where.dim] = where.stop - where.start + where.pad
    return out


def _read_rows(fh: Any, stored: StoredTensor, first: int, row_bytes: int,
               into: torch.Tensor) -> None:
    """Fill contiguous `into` (stored's dtype) with the file's rows from row `first` on."""
    if sys.byteorder != "little":  # safetensors stores little-endian
        raise ValueError("reading safetensors needs a little-endian machine")
    want = into.numel() * into.element_size()
    fh.seek(stored.start + first * row_bytes)
    if want and fh.readinto(memoryview(into.view(-1).view(torch.uint8).numpy())) != want:
        raise ValueError(f"{stored.file} became shorter while tensor {stored.key} was read")


def _check_finite(stored: StoredTensor, t: torch.Tensor) -> None:
    """ValueError naming the tensor if `t` (a part of it) holds NaN or inf; checked in
    blocks so isfinite's temporaries stay small."""
    if not t.is_floating_point():
        return
    flat = t.reshape(-1)
    step = max(1, BLOCK_BYTES // t.element_size())
    if any(not bool(torch.isfinite(part).all()) for part in flat.split(step)):
        raise NotFinite(f"{stored.file}: tensor {stored.key} holds NaN or inf: training "
                        "from it would skip every step")


def _blocks(fh: Any, stored: StoredTensor, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Rows [lo, hi) of `stored` as (first row, rows) blocks of about BLOCK_BYTES, each
    read into one reused buffer of the stored dtype, shaped (rows, dim 1, the rest)."""
    shape = stored.shape or (1,)
    grid = (shape[1] if len(shape) > 1 else 1, math.prod(shape[2:]))
    stored_dtype = DTYPES[stored.dtype]
    row_bytes = math.prod(grid) * stored_dtype.itemsize
    block = max(1, BLOCK_BYTES // max(1, row_bytes))
    buffer = torch.empty((min(block, max(hi - lo, 1)), *grid), dtype=stored_dtype)
    for first in range(lo, hi, block):
        got = buffer[: min(block, hi - first)]
        _read_rows(fh, stored, first, row_bytes, got)
        yield first, got


def scan_finite(stored: StoredTensor) -> None:
    """NotFinite naming the tensor if any of it is NaN or inf, read one block at a time
    (never the whole tensor in memory)."""
    try:
        with open(stored.file, "rb") as fh:
            for _, got in _blocks(fh, stored, 0, (stored.shape or (1,))[0]):
                _check_finite(stored, got)
    except OSError as e:
        raise ValueError(f"cannot read {stored.file}: {e.strerror or e}") from None


def read_slice(stored: StoredTensor, where: ShardSlice, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows [where.start, where.stop) along where.dim of `stored` (the whole tensor when
    where.dim is None), in `dtype`, with where.pad zero rows appended, made on `device`;
    NotFinite naming the file and tensor if the slice holds NaN or inf, ValueError if
    the file changed under us. Off the CPU the rows go through one host block at a
    time straight into the device tensor (no host copy of the whole shard)."""
    out = torch.empty(_shard_shape(stored.shape, where), dtype=dtype, device=device)
    if where.pad:
        out.narrow(where.dim or 0, out.shape[where.dim or 0] - where.pad, where.pad).zero_()
    # Tensors seen as (rows, dim 1, the rest): a dim-0 shard is a row range of the file,
    # a dim-1 shard a column range of every row.
    shape, out_shape = stored.shape or (1,), out.shape or (1,)
    kept = out.view(out_shape[0], out_shape[1] if len(out_shape) > 1 else 1,
                    math.prod(shape[2:]))
    lo, hi = (where.start, where.stop) if where.dim == 0 else (0, shape[0])
    cols = slice(where.start, where.stop) if where.dim == 1 else slice(None)
    width = where.stop - where.start if where.dim == 1 else kept.shape[1]
    on_host = out.device.type == "cpu"
    try:
        with open(stored.file, "rb") as fh:
            if on_host and where.dim != 1 and DTYPES[stored.dtype] == dtype:  # bytes are ours
                row_bytes = math.prod(shape[1:]) * dtype.itemsize
                _read_rows(fh, stored, lo, row_bytes, kept[: hi - lo])
            else:  # a cast, some columns of each row, or a device: through one small buffer
                for first, got in _blocks(fh, stored, lo, hi):
                    if not on_host:  # checked on the host as it arrives: no device syncs
                        _check_finite(stored, got[:, cols])
                    kept[first - lo : first - lo + len(got), :width].copy_(got[:, cols])
    except OSError as e:
        raise ValueError(f"cannot read {stored.file}: {e.strerror or e}") from None
    if on_host:
        _check_finite(stored, out)
    return out
