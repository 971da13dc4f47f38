"""Megatron-LM's indexed dataset (`PREFIX.idx` + `PREFIX.bin`, `MMIDIDX` version 1),
read through a memory map and written by `stp data prepare`.

The `.idx` holds a 34-byte header (magic `MMIDIDX\\0\\0`, version `<Q`, dtype code
`<B`, sequence count `<Q`, document-index count `<Q`), then the int32 length of
every sequence, the int64 byte offset of every sequence in the `.bin`, and the
int64 document index (the sequence each document starts at, ending with the
sequence count). The `.bin` is the token ids of every sequence back to back.

Both files come from elsewhere: every count is checked against the file sizes
before anything is mapped, so a truncated, oversized or edited index is one
line naming the file, never a wrong read or a huge allocation. Megatron's
optional per-sequence modes (its multimodal datasets) are refused.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from stp.train.data.detect import megatron_prefix
from stp.train.data.source import MappedTokens, first_out_of_vocab

__all__ = ["MAGIC", "TOKEN_DTYPES", "MegatronTokens", "MegatronWriter", "dtype_for_vocab",
           "megatron_prefix"]

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
TOKEN_DTYPES = {code: t for code, t in DTYPE_CODES.items() if np.issubdtype(t, np.integer)}


def dtype_for_vocab(vocab: int) -> type[np.integer]:
    """The token type Megatron-LM's preprocessing picks: uint16 below 65,500 ids."""
    return np.uint16 if vocab < 65_500 else np.int32


class MegatronTokens(MappedTokens):
    """The token ids of a Megatron dataset as one stream (documents back to back)."""

    kind = "megatron"

    def __init__(self, prefix: str | os.PathLike[str], vocab: int | None = None) -> None:
        self.prefix = Path(prefix)
        idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        self.dtype, lengths, documents = _read_index(idx, bin_.stat().st_size)
        self.documents = documents
        self.lengths = lengths
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r") if lengths.sum() else \
            np.zeros(0, self.dtype)
        if vocab is not None:
            bad = first_out_of_vocab(self.tokens, vocab)
            if bad is not None:
                raise ValueError(f"{bin_}: token id {int(self.tokens[bad])} at token offset {bad} "
                                 f"is outside the model's vocabulary of {vocab} (give the "
                                 "tokenizer that prepared it: --tokenizer)")


def _read_index(idx: Path, bin_bytes: int) -> tuple[Any, np.ndarray, int]:
    """(token type, sequence lengths, documents) of a checked `.idx`; ValueError naming
    it for anything that is not a whole, consistent MMIDIDX version 1 index. (The token
    type is a numpy scalar type, typed Any: numpy's stubs type those loosely.)"""
    size = idx.stat().st_size
    if size < _HEADER.size:
        raise ValueError(f"{idx}: {size} bytes, shorter than the {_HEADER.size}-byte MMIDIDX "
                         "header (truncated?)")
    with open(idx, "rb") as f:
        magic, version, code, sequences, doc_index = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise ValueError(f"{idx}: not a Megatron index (no MMIDIDX magic)")
    if version != 1:
        raise ValueError(f"{idx}: MMIDIDX version {version}; stp reads version 1")
    if code not in TOKEN_DTYPES:
        known = ", ".join(f"{c} {np.dtype(t).name}" for c, t in TOKEN_DTYPES.items())
        raise ValueError(f"{idx}: dtype code {code} is not a token id type (accepted: {known})")
    expected = _HEADER.size + 12 * sequences + 8 * doc_index
    if size == expected + sequences and sequences:
        raise ValueError(f"{idx}: holds Megatron's per-sequence modes (a multimodal dataset); "
                         "stp reads text datasets only")
    if size != expected:
        raise ValueError(f"{idx}: {size} bytes, but its header ({sequences} sequences, "
                         f"{doc_index} document indices) needs {expected} (truncated or damaged)")
    dtype = TOKEN_DTYPES[code]
    item = np.dtype(dtype).itemsize
    lengths = np.fromfile(idx, np.int32, sequences, offset=_HEADER.size) if sequences else \
        np.zeros(0, np.int32)
    if (lengths < 0).any():
        raise ValueError(f"{idx}: a negative sequence length")
    pointers = np.fromfile(idx, np.int64, sequences, offset=_HEADER.size + 4 * sequences)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * item
    if not np.array_equal(pointers, starts[:sequences]):
        raise ValueError(f"{idx}: sequence offsets are not the sequences back to back")
    needed = int(lengths.sum(dtype=np.int64)) * item
    if needed != bin_bytes:
        raise ValueError(f"{idx.with_suffix('.bin')}: {bin_bytes} bytes, but {idx.name} "
                         f"describes {needed} (truncated, oversized or another dataset's)")
    docs = np.fromfile(idx, np.int64, doc_index, offset=_HEADER.size + 12 * sequences)
    if doc_index < 1 or docs[0] != 0 or docs[-1] != sequences or (np.diff(docs) < 0).any():
        raise ValueError(f"{idx}: the document index does not run from 0 to the sequence count")
    return dtype, lengths, doc_index - 1


class MegatronWriter:
    """Writes documents (one sequence each) as a Megatron dataset at `prefix`, into
    temporary files renamed into place by `finish` (a reader never sees half of one)."""

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.integer]) -> None:
        self.prefix, self.dtype = Path(prefix), dtype
        self._tmp = Path(f"{prefix}.bin.{os.getpid()}.tmp")
        self._bin = open(self._tmp, "wb")  # noqa: SIM115 (closed by finish)
        self.lengths: list[int] = []

    def add(self, ids: Iterable[int]) -> None:
        arr = np.asarray(list(ids), dtype=np.int64)
        info = np.iinfo(self.dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ValueError(f"token ids do not fit {np.dtype(self.dtype).name}")
        self._bin.write(arr.astype(self.dtype).tobytes())
        self.lengths.append(int(arr.size))

    def finish(self) -> Path:
        self._bin.close()
        n = len(self.lengths)
        lengths = np.asarray(self.lengths, dtype=np.int32)
        item = np.dtype(self.dtype).itemsize
        pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * item
        code = next(c for c, t in TOKEN_DTYPES.items() if t == self.dtype)
        idx_tmp = Path(f"{self.prefix}.idx.{os.getpid()}.tmp")
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, 1, code, n, n + 1))
            f.write(lengths.tobytes())
            f.write(pointers[:n].astype(np.int64).tobytes())
            f.write(np.arange(n + 1, dtype=np.int64).tobytes())
        os.replace(self._tmp, f"{self.prefix}.bin")
        os.replace(idx_tmp, f"{self.prefix}.idx")
        return self.prefix
