"""Byte-level training data: a real corpus every machine has, read deterministically.

Default corpus: the Python standard library's own source files (the `*.py`
files at the top of `sysconfig.get_paths()["stdlib"]`, sorted by name),
concatenated as bytes up to a cap. `--data PATH` takes a file or a directory
(every regular file under it, sorted by relative path). Tokens are bytes, so
the vocabulary is 256.

Batches are a pure function of (seed, step): every rank draws the same
global batch and takes its own slice, so the same seed and data give the
same losses on one process and on any mesh with the same global batch.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["VOCAB_SIZE", "read_corpus", "stdlib_files", "ByteBatches", "split_batch"]

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4 << 20


def stdlib_files() -> list[Path]:
    """The standard library's top-level `*.py` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        files.extend(Path(dirpath) / f for f in sorted(filenames))
    return [f for f in files if f.is_file()]


def read_corpus(
    path: str | os.PathLike[str] | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes:
    """The corpus as bytes: `path` (a file or a directory) or the stdlib sources.

    Raises ValueError naming the path when it is missing or holds too little
    text to train on.
    """
    if path is None:
        files, what = stdlib_files(), "the Python standard library"
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"data path {str(path)!r} does not exist; give a file or a directory")
        files, what = _files_under(p), repr(str(path))
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        data = f.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    corpus = b"".join(chunks)
    if len(corpus) < 1024:
        raise ValueError(f"data {what} holds {len(corpus)} bytes; at least 1024 are needed")
    return corpus


@dataclass
class ByteBatches:
    """Random windows of `seq_len + 1` bytes; batch t is fixed by (seed, t)."""

    corpus: torch.Tensor
    """uint8 tensor of the whole corpus."""
    seq_len: int
    batch_size: int
    """Global batch: sequences per step over all DP replicas and microbatches."""
    seed: int = 0

    @classmethod
    def from_bytes(cls, data: bytes, seq_len: int, batch_size: int, seed: int = 0) -> ByteBatches:
        if len(data) < seq_len + 2:
            raise ValueError(
                f"corpus of {len(data)} bytes is shorter than seq_len + 2 = {seq_len + 2}"
            )
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_len, batch_size, seed)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each int64 [batch_size, seq_len]; targets = tokens shifted by one."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.corpus.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.corpus[idx].long()
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
