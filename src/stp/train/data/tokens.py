"""Tokenised training data: text -> token ids with a Hugging Face `tokenizers`
tokenizer.json, documents joined with the EOS token and packed into sequences.

Each file of the data (a file, a directory, or the default corpus of
stp.train.data.corpus, capped alike) is one document: its text (UTF-8, invalid
bytes replaced) is encoded with the tokenizer's own special tokens (a BOS
where its post-processor adds one) and followed by the EOS token. The
stream of every document in order is cut into sequences of seq_len + 1
tokens (the last partial one dropped); a step's global batch takes the next
rows of a seeded permutation of the sequences, a new permutation each epoch,
so batches are a pure function of (seed, step) as the byte batches are.

The token ids are computed once and cached as int32 (this machine's byte
order) next to
the data (`.<name>.stp-tokens/<key>.bin`, or under ~/.cache/stp/tokens when
that directory cannot be written, and for the default corpus), the key a
hash of the tokenizer file, the EOS id and the data's bytes: a second run
with the same tokenizer and data reads the cache, any change makes a new
one. Ranks read only the sequences of their batches from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from stp.files import read_json_object
from stp.train.data.corpus import ByteBatches, Corpus, open_corpus
from stp.train.data.source import TokenSource

__all__ = ["TokenStream", "TokenBatches", "Tokenizer", "eos_id", "find_tokenizer",
           "make_batches", "run_tokenizer", "tokenize", "tokenizer_vocab"]

_TOKEN_BYTES = 4
assert array("i").itemsize == _TOKEN_BYTES
_EPOCH_SEED = 7_919


class Tokenizer(NamedTuple):
    """The tokenizer a run's text is cut with."""

    path: Path
    """Its tokenizer.json."""
    eos: int
    """The id that ends every document."""


def run_tokenizer(tokenizer: str | None, init_from: str | None) -> Tokenizer | None:
    """`--tokenizer`'s, else the `--init-from` checkpoint's tokenizer with its EOS id
    (config.json's `eos_token_id`, else tokenizer_config.json's), None: bytes."""
    path = find_tokenizer(tokenizer, init_from)
    if path is None:
        return None
    config = None
    if init_from is not None and (Path(init_from) / "config.json").is_file():
        config = read_json_object(Path(init_from) / "config.json")  # a list: one line
    return Tokenizer(path, eos_id(path, config))


def find_tokenizer(tokenizer: str | None, init_from: str | None) -> Path | None:
    """The tokenizer.json to use: `tokenizer` (a file, or a directory holding one),
    else the init_from checkpoint's when it has one, else None (byte-level data)."""
    if tokenizer is not None:
        p = Path(tokenizer)
        p = p / "tokenizer.json" if p.is_dir() else p
        if not p.is_file():
            raise ValueError(f"--tokenizer {tokenizer!r}: no tokenizer.json there")
        return p
    if init_from is not None and (Path(init_from) / "tokenizer.json").is_file():
        return Path(init_from) / "tokenizer.json"
    return None


def _load(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types
        raise ValueError(f"{path}: not a tokenizers tokenizer.json ({e})") from None


def tokenizer_vocab(path: Path) -> int:
    """Token ids the tokenizer can produce (its vocabulary with added tokens)."""
    return int(_load(path).get_vocab_size(with_added_tokens=True))


def eos_id(path: Path, config: dict[str, Any] | None = None) -> int:
    """The EOS token id: config.json's `eos_token_id` (the first one of a list), else
    tokenizer_config.json's `eos_token` next to the tokenizer; ValueError if neither."""
    eos = (config or {}).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, int) and not isinstance(eos, bool):
        return eos
    side = path.parent / "tokenizer_config.json"
    token = json.loads(side.read_text()).get("eos_token") if side.is_file() else None
    if isinstance(token, dict):
        token = token.get("content")
    found = _load(path).token_to_id(token) if isinstance(token, str) else None
    if found is None:
        raise ValueError(f"{path}: no EOS token known (give eos_token_id in config.json or "
                         f"eos_token in {side.name})")
    return int(found)


def _cache_dir(data: str | None) -> list[Path]:
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stp" / "tokens"
    if data is None:
        return [home]
    p = Path(data).resolve()
    return [p.parent / f".{p.name}.stp-tokens", home]


def _key(tokenizer: Path, eos: int, corpus: Corpus) -> str:
    h = hashlib.sha256(tokenizer.read_bytes())
    h.update(f"|eos={eos}|".encode())
    for f, n in zip(corpus.files, corpus.sizes, strict=True):
        h.update(f"{f.name}:{n}|".encode())
        with open(f, "rb") as handle:
            h.update(handle.read(n))
    return h.hexdigest()[:24]


def _write_tokens(tokenizer: Path, eos: int, corpus: Corpus, out: Path) -> None:
    tok = _load(tokenizer)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for file, n in zip(corpus.files, corpus.sizes, strict=True):
            text = file.read_bytes()[:n].decode("utf-8", errors="replace")
            f.write(array("i", [*tok.encode(text).ids, eos]).tobytes())
    os.replace(tmp, out)  # atomic: ranks tokenising at once each write a whole file


def tokenize(data: str | None, tokenizer: Path, eos: int) -> Path:
    """The cached token file of `data` (None: the default corpus), written if missing."""
    corpus = open_corpus(data)
    name = f"{_key(tokenizer, eos, corpus)}.bin"
    dirs = _cache_dir(data)
    for d in dirs:
        if (d / name).is_file():
            return d / name
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            _write_tokens(tokenizer, eos, corpus, d / name)
            return d / name
        except OSError:
            continue
    raise ValueError(f"cannot write the token cache in any of {', '.join(map(str, dirs))}")


@dataclass
class TokenStream:
    """Token ids of a cache file, read by position."""

    path: Path

    @property
    def size(self) -> int:
        return self.path.stat().st_size // _TOKEN_BYTES

    def read(self, start: int, length: int) -> torch.Tensor:
        with open(self.path, "rb") as f:
            raw = os.pread(f.fileno(), length * _TOKEN_BYTES, start * _TOKEN_BYTES)
        if len(raw) != length * _TOKEN_BYTES:
            raise ValueError(f"token file {self.path} is shorter than expected")
        return torch.frombuffer(bytearray(raw), dtype=torch.int32).long()


@dataclass
class TokenBatches:
    """Packed sequences of `seq_len + 1` tokens; batch t is fixed by (seed, t)."""

    stream: TokenSource
    """Token ids by position: a token cache, a Megatron dataset, a flat token file."""
    seq_len: int
    batch_size: int
    """Global batch: sequences per step over all DP replicas and microbatches."""
    seed: int = 0
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.sequences = self.stream.size // (self.seq_len + 1)
        if self.sequences < 1:
            raise ValueError(f"tokenised data holds {self.stream.size} tokens, fewer than "
                             f"--seq-len + 1 = {self.seq_len + 1}")

    def _row(self, i: int) -> int:
        epoch, pos = divmod(i, self.sequences)
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * _EPOCH_SEED)
            self._perms = {epoch: torch.randperm(self.sequences, generator=gen)}
        return int(self._perms[epoch][pos])

    def sequence(self, i: int) -> torch.Tensor:
        """The i-th packed sequence drawn (seq_len + 1 ids): epoch i // sequences."""
        span = self.seq_len + 1
        return self.stream.read(self._row(i) * span, span)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each int64 [batch_size, seq_len]; targets shifted by one."""
        first = step * self.batch_size
        window = torch.stack([self.sequence(i) for i in range(first, first + self.batch_size)])
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def make_batches(data: str | None, tokenizer: Tokenizer | None, seq_len: int,
                 global_batch: int, seed: int) -> ByteBatches | TokenBatches:
    """The global batches of `data` (None: the default corpus): TokenBatches when a
    tokenizer applies, else ByteBatches (byte-level)."""
    if tokenizer is None:
        return ByteBatches(open_corpus(data), seq_len, global_batch, seed)
    stream = TokenStream(tokenize(data, tokenizer.path, tokenizer.eos))
    return TokenBatches(stream, seq_len, global_batch, seed)
