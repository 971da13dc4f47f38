"""Byte-level training data: a real corpus every machine has, read deterministically.

Default corpus: the Python standard library's own source files (the `*.py`
files at the top of `sysconfig.get_paths()["stdlib"]`, sorted by name),
concatenated as bytes up to a cap (DEFAULT_MAX_BYTES). `--data PATH` takes
a file or a directory (every regular text file under it, sorted by relative
path: hidden files and directories, `__pycache__` and binary files, those
with a NUL byte in their first BINARY_PROBE bytes as git judges them, are
skipped and counted), all of it. Tokens are bytes, so the vocabulary is 256.

Read in pieces: a `Corpus` knows its files and sizes and reads only the
windows a batch needs (a positioned read each), so a rank holds a few
kilobytes of data whatever the size of `--data` (reading a 1 GB file whole
into every worker cost each 1 GB of memory).

Batches are a pure function of (seed, step): every rank draws the same
global batch and takes its own slice, so the same seed and data give the
same losses on one process and on any mesh with the same global batch.
"""

from __future__ import annotations

import bisect
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stp.train.run.precheck import check_data_path

__all__ = [
    "VOCAB_SIZE", "DEFAULT_MAX_BYTES", "MIN_BYTES", "Corpus", "open_corpus", "read_corpus",
    "stdlib_files", "ByteBatches", "split_batch",
]

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4 << 20
"""Cap of the default corpus (and of `read_corpus`)."""
MIN_BYTES = 1024


def stdlib_files() -> list[Path]:
    """The standard library's top-level `*.py` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


BINARY_PROBE = 8192
"""Bytes of a file read to tell text from binary (git reads as many)."""
SKIPPED_DIRS = ("__pycache__",)


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_PROBE)


def _files_under(path: Path) -> tuple[list[Path], int]:
    """(the text files of `path`, how many files under it were skipped)."""
    if path.is_file():
        return [path], 0
    files, skipped = [], 0
    for dirpath, dirnames, filenames in os.walk(path):
        keep = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIPPED_DIRS)
        skipped += sum(len(fs) for d in set(dirnames) - set(keep)
                       for _, _, fs in os.walk(Path(dirpath) / d))
        dirnames[:] = keep
        for name in sorted(filenames):
            f = Path(dirpath) / name
            if name.startswith(".") or not f.is_file() or _is_binary(f):
                skipped += 1
            else:
                files.append(f)
    return files, skipped


class ByteSource(Protocol):
    """Bytes addressed by offset: a `Corpus` on disk, or bytes in memory."""

    @property
    def size(self) -> int: ...

    def read(self, start: int, length: int) -> bytes: ...


class Corpus:
    """Files read as one sequence of bytes, on demand.

    `files[i]` contributes its first `sizes[i]` bytes (the last file is cut
    where a cap falls) at offset `starts[i]` of the sequence.
    """

    def __init__(self, files: list[Path], sizes: list[int], what: str,
                 skipped: int = 0) -> None:
        self.files, self.sizes, self.what = files, sizes, what
        self.skipped = skipped
        """Files under a --data directory left out (hidden, __pycache__, binary)."""
        self.starts = [0]
        for n in sizes[:-1]:
            self.starts.append(self.starts[-1] + n)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def read(self, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of the sequence (across file boundaries)."""
        if start < 0 or start + length > self.size:
            raise ValueError(f"bytes [{start}, {start + length}) outside data {self.what} "
                             f"of {self.size} bytes")
        out = bytearray()
        i = bisect.bisect_right(self.starts, start) - 1
        while len(out) < length:
            offset = start + len(out) - self.starts[i]
            want = min(length - len(out), self.sizes[i] - offset)
            with open(self.files[i], "rb") as f:
                chunk = os.pread(f.fileno(), want, offset)
            if len(chunk) != want:
                raise ValueError(f"data file {str(self.files[i])!r} became shorter while "
                                 "training; give data that stays as it is")
            out += chunk
            i += 1
        return bytes(out)


def open_corpus(
    path: str | os.PathLike[str] | None = None, *, max_bytes: int | None = None
) -> Corpus:
    """The corpus at `path` (a file or a directory), or the stdlib sources capped
    at DEFAULT_MAX_BYTES; `max_bytes` caps either. Reads nothing but sizes.

    Raises ValueError naming the path when it is missing or holds too little
    text to train on.
    """
    skipped = 0
    if path is None:
        files, what = stdlib_files(), "the Python standard library"
        max_bytes = min(max_bytes or DEFAULT_MAX_BYTES, DEFAULT_MAX_BYTES)
    else:
        p = Path(path)
        check_data_path(str(path))  # ValueError naming it when missing
        files, skipped = _files_under(p)
        what = repr(str(path))
    used, sizes, total = [], [], 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        n = f.stat().st_size
        n = n if max_bytes is None else min(n, max_bytes - total)
        if n:
            used.append(f)
            sizes.append(n)
            total += n
    if total < MIN_BYTES:
        raise ValueError(f"data {what} holds {total} bytes; at least {MIN_BYTES} are needed")
    return Corpus(used, sizes, what, skipped)


def read_corpus(
    path: str | os.PathLike[str] | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes:
    """The first `max_bytes` bytes of `open_corpus(path)`, in memory (ValueError as
    open_corpus)."""
    corpus = open_corpus(path, max_bytes=max_bytes)
    return corpus.read(0, corpus.size)


@dataclass(frozen=True)
class _InMemory:
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    def read(self, start: int, length: int) -> bytes:
        return self.data[start : start + length]


@dataclass
class ByteBatches:
    """Random windows of `seq_len + 1` bytes; batch t is fixed by (seed, t)."""

    source: ByteSource
    """The corpus (read window by window)."""
    seq_len: int
    batch_size: int
    """Global batch: sequences per step over all DP replicas and microbatches."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source.size < self.seq_len + 2:
            raise ValueError(f"corpus of {self.source.size} bytes is shorter than seq_len + 2 = "
                             f"{self.seq_len + 2}")

    @classmethod
    def from_bytes(cls, data: bytes, seq_len: int, batch_size: int, seed: int = 0) -> ByteBatches:
        return cls(_InMemory(bytes(data)), seq_len, batch_size, seed)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each int64 [batch_size, seq_len]; targets = tokens shifted by one."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.source.size - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=gen)
        span = self.seq_len + 1
        raw = bytearray().join(self.source.read(s, span) for s in starts.tolist())
        window = torch.frombuffer(raw, dtype=torch.uint8).view(self.batch_size, span).long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def split_batch(
    batch: torch.Tensor, dp: int, dp_rank: int, num_microbatches: int
) -> list[torch.Tensor]:
    """This replica's microbatches of a global batch [B, ...]: replica d takes
    rows [d B/dp, (d+1) B/dp), cut into num_microbatches equal parts."""
    rows = batch.shape[0]
    if rows % (dp * num_microbatches):
        raise ValueError(
            f"global batch of {rows} rows does not split into dp={dp} x "
            f"{num_microbatches} microbatches of equal size"
        )
    per = rows // dp
    mine = batch[dp_rank * per : (dp_rank + 1) * per]
    return list(mine.chunk(num_microbatches))
