"""What every token source of `--data` shares: the summary a run's first line gives
(format, documents, tokens, skipped) and the vocabulary check of stored ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = ["DataSummary", "MappedTokens", "TokenSource", "first_out_of_vocab"]

_SCAN = 1 << 24
"""Token ids checked per slice: a memory-mapped file is scanned without reading it whole."""


@dataclass(frozen=True)
class DataSummary:
    format: str
    path: str
    documents: int | None
    """None: not known (a flat token file without an EOS id)."""
    tokens: int
    skipped: int
    """Documents left out (empty or null texts, binary files)."""
    cut: int | None = None
    """Chat data: conversations longer than --seq-len + 1 tokens, cut at the end."""

    def line(self) -> str:
        docs = "unknown documents (no EOS id)" if self.documents is None else \
            f"{self.documents:,} documents"
        cut = "" if self.cut is None else f", {self.cut:,} cut at --seq-len"
        return (f"{self.format} {self.path}: {docs}, {self.tokens:,} tokens, "
                f"{self.skipped:,} skipped{cut}")


class TokenSource(Protocol):
    """Token ids addressed by position: one stream, documents back to back."""

    @property
    def size(self) -> int: ...

    def read(self, start: int, length: int) -> torch.Tensor: ...


def first_out_of_vocab(ids: np.ndarray, vocab: int) -> int | None:
    """The offset of the first id outside [0, vocab), None when every id is inside."""
    for start in range(0, ids.shape[0], _SCAN):
        part = ids[start:start + _SCAN]
        bad = (part >= vocab) | (part < 0) if np.issubdtype(part.dtype, np.signedinteger) \
            else part >= vocab
        if bad.any():
            return start + int(np.argmax(bad))
    return None


class MappedTokens:
    """A token file read through a memory map as one stream (documents back to back):
    what the Megatron dataset and the flat token file share once opened. A rank
    touches only the sequences it reads."""

    kind = "tokens"
    """The format's name in the run's first line."""
    tokens: np.ndarray
    documents: int | None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, start: int, length: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[start:start + length].astype(np.int64))

    def summary(self, what: str) -> DataSummary:
        return DataSummary(self.kind, what, self.documents, self.size, 0)
