"""Tokenise documents once into a Megatron dataset (`stp data prepare`, and the cache
a run of JSONL / Parquet / save_to_disk data trains from).

Every document is encoded with the tokenizer's own special tokens and followed by
the EOS id (as text data is, stp.train.data.tokens). Worker processes encode
chunks of documents and the chunks are written in input order, so any number of
workers writes the same bytes as one. Beside `PREFIX.idx`/`PREFIX.bin` goes
`PREFIX.hist.json`: documents, tokens, skipped rows and the document-length
histogram (power-of-two bins), which the cost model can read a mean from.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from stp.files import read_json, write_text_atomic
from stp.train.data.megatron import MegatronWriter, dtype_for_vocab

__all__ = ["Prepared", "encode_documents", "histogram", "prepare", "read_skipped",
           "text_documents"]

_CHUNK = 256
"""Documents one worker encodes per task."""

_tokenizer: Any = None


def _load_worker(path: str) -> None:
    global _tokenizer
    from tokenizers import Tokenizer

    _tokenizer = Tokenizer.from_file(path)


def _encode_chunk(args: tuple[list[str | None], int]) -> list[list[int] | None]:
    texts, eos = args
    out: list[list[int] | None] = []
    for text in texts:
        out.append(None if text is None else [*_tokenizer.encode(text).ids, eos])
    return out


def _chunks(texts: Iterable[str | None], eos: int) -> Iterator[tuple[list[str | None], int]]:
    chunk: list[str | None] = []
    for t in texts:
        chunk.append(t)
        if len(chunk) == _CHUNK:
            yield chunk, eos
            chunk = []
    if chunk:
        yield chunk, eos


def encode_documents(texts: Iterable[str | None], tokenizer: Path, eos: int,
                     workers: int = 1) -> Iterator[list[int] | None]:
    """Each text's ids followed by `eos` (None stays None: a skipped row), in order."""
    if workers <= 1:
        _load_worker(str(tokenizer))
        for chunk in _chunks(texts, eos):
            yield from _encode_chunk(chunk)
        return
    ctx = multiprocessing.get_context("spawn")  # a forked Rust tokenizer can deadlock
    with ctx.Pool(workers, _load_worker, (str(tokenizer),)) as pool:
        for encoded in pool.imap(_encode_chunk, _chunks(texts, eos)):
            yield from encoded


def text_documents(path: str) -> Iterator[str]:
    """Each text file of `path` (a file or a directory, as `--data` text) as one document."""
    from stp.train.data.corpus import _files_under  # hidden, cache and binary files skipped

    files, _ = _files_under(Path(path))
    for file in files:
        with open(file, "rb") as f:
            yield f.read().decode("utf-8", errors="replace")


def histogram(lengths: list[int]) -> list[dict[str, int]]:
    """Document lengths in power-of-two bins: `upto` is each bin's inclusive top."""
    counts: dict[int, int] = {}
    for n in lengths:
        top = 1 << max(0, (n - 1).bit_length())
        counts[top] = counts.get(top, 0) + 1
    return [{"upto": top, "count": counts[top]} for top in sorted(counts)]


@dataclass(frozen=True)
class Prepared:
    prefix: Path
    documents: int
    tokens: int
    skipped: int
    seconds: float


class _Progress:
    """A one-line progress report on a terminal, redrawn at most every half second."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream, self.last = stream, 0.0

    def show(self, documents: int, tokens: int, *, done: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not done and now - self.last < 0.5):
            return
        self.last = now
        end = "\n" if done else ""
        print(f"\rtokenising: {documents:,} documents, {tokens:,} tokens", end=end,
              file=self.stream, flush=True)


def prepare(texts: Iterable[str | None], tokenizer: Path, eos: int, vocab: int, out: Path,
            workers: int = 1, progress: TextIO | None = None) -> Prepared:
    """Write `out`.idx/.bin/.hist.json from `texts` (None: a skipped row)."""
    start = time.perf_counter()
    writer = MegatronWriter(out, dtype_for_vocab(vocab))
    bar, skipped, tokens = _Progress(progress), 0, 0
    for ids in encode_documents(texts, tokenizer, eos, workers):
        if ids is None:
            skipped += 1
            continue
        writer.add(ids)
        tokens += len(ids)
        bar.show(len(writer.lengths), tokens)
    if not writer.lengths:
        writer.finish()
        raise ValueError(f"no documents to write to {out} ({skipped} empty rows skipped)")
    writer.finish()
    bar.show(len(writer.lengths), tokens, done=True)
    lengths = writer.lengths
    info = {"documents": len(lengths), "tokens": tokens, "skipped": skipped,
            "mean_length": tokens / len(lengths), "eos": eos,
            "lengths": histogram(lengths)}
    write_text_atomic(Path(f"{out}.hist.json"), json.dumps(info, indent=1) + "\n")
    return Prepared(out, len(lengths), tokens, skipped, time.perf_counter() - start)


def read_skipped(prefix: Path) -> int:
    """The skipped rows `prepare` recorded beside `prefix` (0 when not recorded)."""
    path = Path(f"{prefix}.hist.json")
    try:
        doc = read_json(path, 1 << 20) if path.is_file() else {}
    except ValueError:  # damaged or oversized: the count is only reported
        return 0
    value = doc.get("skipped", 0) if isinstance(doc, dict) else 0
    return value if isinstance(value, int) and value >= 0 else 0

