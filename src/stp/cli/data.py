"""`stp data prepare`: tokenise once into a Megatron indexed dataset, so that a
hundred ranks read token ids instead of each tokenising the text.

    stp data prepare corpus.jsonl more/ --tokenizer tok/ --out data/corpus --workers 8
    stp train --data data/corpus --tokenizer tok/ ...
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data", help="prepare training data (tokenise once into a Megatron dataset)",
        description="Work on training data (docs/data.md).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    prep = actions.add_parser(
        "prepare", help="tokenise text, JSONL, Parquet or save_to_disk data into PREFIX.idx/.bin",
        description="Tokenise INPUTs (text files or directories, *.jsonl, *.parquet, "
        "save_to_disk directories; each document followed by the EOS id) into a Megatron "
        "indexed dataset PREFIX.idx + PREFIX.bin, with the document-length histogram in "
        "PREFIX.hist.json. Any number of --workers writes the same bytes.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT")
    prep.add_argument("--tokenizer", required=True, metavar="PATH",
                      help="tokenizer.json, or a directory holding one")
    prep.add_argument("--out", required=True, metavar="PREFIX",
                      help="writes PREFIX.idx, PREFIX.bin, PREFIX.hist.json")
    prep.add_argument("--workers", type=int, default=1, metavar="N",
                      help="tokenising processes (default 1)")
    prep.add_argument("--data-column", default="text", metavar="NAME",
                      help="the text column of JSONL / Parquet / save_to_disk inputs")
    prep.add_argument("--eos-id", type=int, default=None, metavar="ID",
                      help="the id that ends each document (default: the tokenizer's EOS)")
    prep.set_defaults(func=run_prepare)


def _texts(inputs: list[str], column: str) -> Iterator[str | None]:
    from stp.train.data.detect import detect_format
    from stp.train.data.prepare import text_documents
    from stp.train.data.records import iter_texts

    formats = [detect_format(path) for path in inputs]  # every input checked before any work
    for path, fmt in zip(inputs, formats, strict=True):
        if fmt in ("megatron", "tokens", "chat"):
            raise ValueError(f"{path!r} is {fmt} data; stp data prepare takes text, JSONL, "
                             "Parquet or save_to_disk inputs")
    for path, fmt in zip(inputs, formats, strict=True):
        yield from (text_documents(path) if fmt == "text" else iter_texts(path, fmt, column))


def run_prepare(args: argparse.Namespace) -> int:
    from stp.train.data.prepare import prepare
    from stp.train.data.tokens import eos_id, find_tokenizer, tokenizer_vocab

    if args.workers < 1 or args.workers > 1024:
        raise ValueError(f"--workers {args.workers}: give 1 to 1024")
    tokenizer = find_tokenizer(args.tokenizer, None)
    assert tokenizer is not None  # --tokenizer is required
    vocab = tokenizer_vocab(tokenizer)
    eos = args.eos_id if args.eos_id is not None else eos_id(tokenizer)
    if not 0 <= eos < vocab:
        raise ValueError(f"--eos-id {eos}: outside the tokenizer's {vocab} ids")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out {args.out!r}: directory {str(out.parent)!r} does not exist")
    texts = _texts(args.inputs, args.data_column)
    first = list(itertools.islice(texts, 1))  # a bad input fails before the workers start
    done = prepare(itertools.chain(first, texts), tokenizer, eos, vocab, out, args.workers,
                   sys.stderr if sys.stderr.isatty() else None)
    print(f"wrote {out}.idx/.bin: {done.documents:,} documents, {done.tokens:,} tokens, "
          f"{done.skipped:,} skipped, in {done.seconds:.1f} s (lengths in {out}.hist.json)")
    return 0
