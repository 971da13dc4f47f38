"""A flat token file as nanoGPT writes it (`train.bin`): token ids back to back,
uint16 (`--token-dtype uint32` for vocabularies over 65,535), documents separated
by the EOS id. Read through a memory map: a rank touches only its sequences."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from stp.train.data.source import MappedTokens, first_out_of_vocab

__all__ = ["TOKEN_FILE_DTYPES", "FlatTokens"]

TOKEN_FILE_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_COUNT = 1 << 24


class FlatTokens(MappedTokens):
    """The ids of a flat token file; `documents` counts its EOS ids (None without one)."""

    def __init__(self, path: str | os.PathLike[str], dtype: str = "uint16",
                 eos: int | None = None, vocab: int | None = None) -> None:
        self.path = Path(path)
        if dtype not in TOKEN_FILE_DTYPES:
            raise ValueError(f"--token-dtype {dtype!r}: choose one of "
                             f"{', '.join(TOKEN_FILE_DTYPES)}")
        item = np.dtype(TOKEN_FILE_DTYPES[dtype]).itemsize
        size = self.path.stat().st_size
        if size == 0 or size % item:
            raise ValueError(f"{self.path}: {size} bytes, not a whole number of {dtype} token "
                             f"ids (--token-dtype {dtype}; a truncated file?)")
        self.tokens = np.memmap(self.path, dtype=TOKEN_FILE_DTYPES[dtype], mode="r")
        if vocab is not None:
            bad = first_out_of_vocab(self.tokens, vocab)
            if bad is not None:
                raise ValueError(f"{self.path}: token id {int(self.tokens[bad])} at token offset "
                                 f"{bad} is outside the model's vocabulary of {vocab} (another "
                                 "tokenizer's file, or --token-dtype wrong?)")
        self.documents = None if eos is None else sum(
            int(np.count_nonzero(self.tokens[i:i + _COUNT] == eos))
            for i in range(0, self.size, _COUNT))
