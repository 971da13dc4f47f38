"""The texts of record files: JSONL and Parquet through pyarrow, a directory
`datasets.Dataset.save_to_disk` wrote through `datasets` (both the optional extra
`stp[data]`). Read in batches: a file larger than memory streams through.

A row whose text is null or empty is skipped and counted; a text column holding
something else than strings, a malformed line or a damaged file is one line naming
the file (and the row)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DATA_EXTRA", "iter_column", "iter_texts"]

DATA_EXTRA = "pip install 'stp[data]'"
_BATCH = 1024


def _need(module: str, what: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"reading {what} needs the optional extra stp[data] ({module} is "
                         f"not installed): {DATA_EXTRA}") from None


def iter_column(path: str | os.PathLike[str], fmt: str, column: str) -> Iterator[Any]:
    """The values of `column` of every row, in file order (fmt: jsonl, parquet, hf)."""
    path = Path(path)
    if fmt == "hf":
        yield from _hf_column(path, column)
        return
    pa = _need("pyarrow", f"{fmt} data")
    try:
        if fmt == "jsonl":
            pj = _need("pyarrow.json", f"{fmt} data")
            reader = pj.open_json(path)
            batches = iter(reader)
        elif fmt == "parquet":
            pq = _need("pyarrow.parquet", f"{fmt} data")
            pf = pq.ParquetFile(path)
            if column not in pf.schema_arrow.names:
                raise _missing(path, column, pf.schema_arrow.names)
            batches = pf.iter_batches(batch_size=_BATCH, columns=[column])
        else:
            raise ValueError(f"no record reader for format {fmt!r}")
        for batch in batches:
            if column not in batch.schema.names:
                raise _missing(path, column, batch.schema.names)
            yield from batch.column(column).to_pylist()
    except (pa.ArrowException, OSError) as e:  # malformed or damaged: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: cannot read it as {fmt} ({first})") from None


def _missing(path: Path, column: str, names: list[str]) -> ValueError:
    return ValueError(f"{path}: no column {column!r} (it has {', '.join(names) or 'none'}); "
                      "name the text column with --data-column")


def _hf_column(path: Path, column: str) -> Iterator[Any]:
    datasets = _need("datasets", "a save_to_disk directory")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # the library raises many types for a damaged directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: cannot load it as a save_to_disk dataset ({first})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (it has "
                             f"{', '.join(ds)})")
        ds = ds["train"]
    if column not in ds.column_names:
        raise _missing(path, column, ds.column_names)
    for batch in ds.select_columns([column]).iter(batch_size=_BATCH):
        yield from batch[column]


def iter_texts(path: str | os.PathLike[str], fmt: str, column: str) -> Iterator[str | None]:
    """Every row's text (None for a null or empty one, to be skipped and counted)."""
    for row, value in enumerate(iter_column(path, fmt, column)):
        if value is None or value == "":
            yield None
        elif isinstance(value, str):
            yield value
        else:
            raise ValueError(f"{path}: row {row}: column {column!r} holds a "
                             f"{type(value).__name__}, not text")
