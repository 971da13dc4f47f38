"""`--data` opened: each source detected (stp.train.data.detect), read as token ids,
packed into batches (one source, or a mixture), with the line a run starts with
and the fingerprint its checkpoints record.

Record formats (JSONL, Parquet, save_to_disk) are tokenised once into a Megatron
dataset cached beside the data (the text cache's place, stp.train.data.tokens),
keyed by the tokenizer, the EOS id, the column and the data's bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stp.train.data.corpus import ByteBatches, open_corpus
from stp.train.data.detect import detect_format, parse_mixture
from stp.train.data.megatron import MegatronTokens, megatron_prefix
from stp.train.data.mixture import MixtureBatches
from stp.train.data.source import DataSummary
from stp.train.data.token_file import FlatTokens
from stp.train.data.tokens import TokenBatches, Tokenizer, TokenStream, _cache_dir, tokenize

__all__ = ["DataOptions", "OpenedData", "check_data", "data_fingerprint", "data_options",
           "open_data"]

_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class DataOptions:
    """How to read `--data` (TrainJob's data fields)."""

    data: str | None
    format: str | None = None
    column: str = "text"
    token_dtype: str = "uint16"
    eos_id: int | None = None


def data_options(job: Any) -> DataOptions:
    """The data fields of a TrainJob."""
    return DataOptions(job.data, job.data_format, job.data_column, job.token_dtype,
                       job.eos_id)


@dataclass
class OpenedData:
    batches: Any
    """`.batch(step)` -> (tokens, targets)."""
    summaries: list[tuple[float, DataSummary]]

    def line(self) -> str:
        """The run's first line: format, documents, tokens and skipped of each source."""
        if len(self.summaries) == 1:
            return "data: " + self.summaries[0][1].line()
        return "data: mixture of " + "; ".join(f"{w:.3g} x {s.line()}"
                                               for w, s in self.summaries)


def _hash_files(h: Any, files: list[Path]) -> None:
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}|".encode())
        with open(f, "rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                h.update(block)


def _record_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _prepared_records(path: str, fmt: str, column: str, tokenizer: Tokenizer,
                      vocab: int) -> tuple[MegatronTokens, int]:
    """The cached Megatron dataset of a record file, written if missing; and its
    skipped rows."""
    from stp.train.data.prepare import prepare, read_skipped
    from stp.train.data.records import iter_texts
    from stp.train.data.tokens import tokenizer_vocab

    h = hashlib.sha256(tokenizer.path.read_bytes())
    h.update(f"|eos={tokenizer.eos}|{fmt}|{column}|".encode())
    _hash_files(h, _record_files(Path(path)))
    key = h.hexdigest()[:24]
    for d in _cache_dir(path):
        if megatron_prefix(d / key) is not None:
            return MegatronTokens(d / key, vocab), read_skipped(d / key)
    for d in _cache_dir(path):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        prepare(iter_texts(path, fmt, column), tokenizer.path, tokenizer.eos,
                max(vocab, tokenizer_vocab(tokenizer.path)), d / key)
        return MegatronTokens(d / key, vocab), read_skipped(d / key)
    raise ValueError(f"cannot write the token cache of {path!r} anywhere")


def _need_tokenizer(path: str, fmt: str, tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise ValueError(f"--data {path!r} is {fmt} text; give --tokenizer PATH to "
                         "tokenise it")
    return tokenizer


def _open_source(path: str, opts: DataOptions, tokenizer: Tokenizer | None,
                 vocab: int | None) -> tuple[Any, DataSummary]:
    """(token source, summary) of one source (text included, tokenised)."""
    fmt = detect_format(path, opts.format)
    if fmt == "megatron":
        prefix = megatron_prefix(path)
        assert prefix is not None  # detect_format found it
        tokens = MegatronTokens(prefix, vocab)
        return tokens, tokens.summary(path)
    if fmt == "tokens":
        eos = opts.eos_id if opts.eos_id is not None else (tokenizer and tokenizer.eos)
        flat = FlatTokens(path, opts.token_dtype, eos, vocab)
        return flat, flat.summary(path)
    if fmt in ("jsonl", "parquet", "hf"):
        tok = _need_tokenizer(path, fmt, tokenizer)
        tokens, skipped = _prepared_records(path, fmt, opts.column, tok,
                                            vocab or 1 << 31)
        return tokens, DataSummary(fmt, path, tokens.documents, tokens.size, skipped)
    if fmt == "chat":
        raise ValueError(f"--data {path!r} is chat data (rows with 'messages'): it trains "
                         "alone, not in a mixture")
    tok = _need_tokenizer(path, "plain", tokenizer)
    corpus = open_corpus(path)
    stream = TokenStream(tokenize(path, tok.path, tok.eos))
    return stream, DataSummary("text", path, len(corpus.files), stream.size, corpus.skipped)


def open_data(opts: DataOptions, tokenizer: Tokenizer | None, vocab: int | None,
              seq_len: int, global_batch: int, seed: int) -> OpenedData:
    """The run's batches and summaries; ValueError (one line naming the file) for data
    that cannot be read as its format says."""
    pairs: list[tuple[float, str | None]] = (
        list(parse_mixture(opts.data)) if opts.data is not None else [(1.0, None)])
    if len(pairs) == 1:
        path = pairs[0][1]
        if tokenizer is None and (path is None or detect_format(path, opts.format) == "text"):
            corpus = open_corpus(path)  # bytes, as before: the vocabulary is 256
            what = "the Python standard library" if path is None else path
            if corpus.size < seq_len + 2:
                raise ValueError(f"data {what!r} holds {corpus.size} bytes, fewer than "
                                 f"--seq-len + 2 = {seq_len + 2}")
            summary = DataSummary("bytes", what, len(corpus.files), corpus.size,
                                  corpus.skipped)
            return OpenedData(ByteBatches(corpus, seq_len, global_batch, seed),
                              [(1.0, summary)])
        if path is None:
            assert tokenizer is not None
            stream = TokenStream(tokenize(None, tokenizer.path, tokenizer.eos))
            files = len(open_corpus(None).files)
            return OpenedData(TokenBatches(stream, seq_len, global_batch, seed),
                              [(1.0, DataSummary("text", "the Python standard library", files,
                                                 stream.size, 0))])
        if detect_format(path, opts.format) == "chat":
            return _open_chat(path, tokenizer, seq_len, global_batch, seed)
        source, summary = _open_source(path, opts, tokenizer, vocab)
        return OpenedData(TokenBatches(source, seq_len, global_batch, seed), [(1.0, summary)])
    opened = [_open_source(str(path), opts, tokenizer, vocab) for _, path in pairs]
    sources = [TokenBatches(src, seq_len, global_batch, MixtureBatches.source_seed(seed, i))
               for i, (src, _) in enumerate(opened)]
    weights = [w for w, _ in pairs]
    return OpenedData(MixtureBatches(sources, weights, seq_len, global_batch, seed),
                      [(w, s) for w, (_, s) in zip(weights, opened, strict=True)])


def _open_chat(path: str, tokenizer: Tokenizer | None, seq_len: int, global_batch: int,
               seed: int) -> OpenedData:
    from stp.train.data.chat import open_chat

    tok = _need_tokenizer(path, "chat", tokenizer)
    batches, summary, cut = open_chat(path, tok.path, seq_len, global_batch, seed)
    return OpenedData(batches, [(1.0, dataclasses.replace(summary, cut=cut))])


def _path_bytes(path: str) -> int:
    prefix = megatron_prefix(path)
    if prefix is not None:
        return sum(Path(f"{prefix}{s}").stat().st_size for s in (".idx", ".bin"))
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0


def data_fingerprint(opts: DataOptions, tokenizer: Tokenizer | None) -> str:
    """A digest of what the batches are made of: each source's path, bytes and weight,
    the reading options and the tokenizer's bytes. Equal data gives equal digests."""
    pairs = parse_mixture(opts.data) if opts.data is not None else [(1.0, None)]
    doc = {
        "sources": [{"weight": round(w, 12), "path": p,
                     "bytes": None if p is None else _path_bytes(p)} for w, p in pairs],
        "format": opts.format, "column": opts.column, "token_dtype": opts.token_dtype,
        "eos_id": opts.eos_id,
        "tokenizer": None if tokenizer is None else
        hashlib.sha256(tokenizer.path.read_bytes()).hexdigest(),
        "eos": None if tokenizer is None else tokenizer.eos,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]



def check_data(job: Any, run: Any) -> OpenedData:
    """`job`'s data opened as its workers will open it (record formats tokenised into
    the cache now, once): ValueError naming the file for data that cannot train."""
    # --data is a text family's (--arch mllm refuses it): its config has a vocabulary
    return open_data(data_options(job), run.tokenizer, run.config.vocab_size,
                     job.model.seq_len, job.global_batch, job.seed)
