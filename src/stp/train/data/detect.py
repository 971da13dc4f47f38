"""What `--data` points at, by fixed precedence (`--data-format` overrides it):

1. `PREFIX` or `PREFIX.bin` with `PREFIX.idx` beside it: a Megatron dataset;
2. another `*.bin` file: a flat token file;
3. a `*.jsonl` file: JSONL records (`chat` when its first row has `messages`);
4. a `*.parquet` file: Parquet records;
5. a directory `datasets.save_to_disk` wrote (`state.json` or `dataset_dict.json`);
6. anything else: text, as before (a file, or a directory of text files).

And `--data 0.7:A,0.3:B`, a mixture: weights (normalised) and paths.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

__all__ = ["FORMATS", "detect_format", "megatron_prefix", "parse_mixture"]

FORMATS = ("megatron", "tokens", "jsonl", "chat", "parquet", "hf", "text")
_WEIGHT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*:(.+)$")
_FIRST_LINE = 1 << 20


def megatron_prefix(path: str | os.PathLike[str]) -> Path | None:
    """The dataset prefix `path` names (`PREFIX` or `PREFIX.bin` with `PREFIX.idx`
    beside it), None when it names no Megatron dataset."""
    p = Path(path)
    candidates = [p.with_suffix("")] if p.suffix == ".bin" else []
    candidates.append(p)
    for prefix in candidates:
        idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        if idx.is_file() and bin_.is_file():
            return prefix
    return None


def _first_row_is_chat(path: Path) -> bool:
    with open(path, "rb") as f:
        line = f.readline(_FIRST_LINE)
    try:
        row = json.loads(line)
    except ValueError:
        return False  # the record reader says what is wrong with it
    return isinstance(row, dict) and "messages" in row


def detect_format(path: str, override: str | None = None) -> str:
    """The format of `path` (see the module doc); ValueError naming the path when it
    does not exist, or when `override` is not a format or does not fit it."""
    if override is not None and override not in FORMATS:
        raise ValueError(f"--data-format {override!r}: choose one of {', '.join(FORMATS)}")
    p = Path(path)
    prefix = megatron_prefix(p)
    if override == "megatron":
        if prefix is None:
            raise ValueError(f"--data-format megatron: no {p.with_suffix('')}.idx and .bin "
                             f"pair at {path!r}")
        return override
    if not p.exists() and prefix is None:
        raise ValueError(f"data path {path!r} does not exist; give a file, a directory or a "
                         "Megatron dataset prefix")
    if override is not None:
        return override
    if prefix is not None:
        return "megatron"
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix == ".bin":
            return "tokens"
        if suffix == ".jsonl":
            return "chat" if _first_row_is_chat(p) else "jsonl"
        if suffix == ".parquet":
            return "parquet"
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        return "hf"
    return "text"


def parse_mixture(data: str) -> list[tuple[float, str]]:
    """`W1:PATH1,W2:PATH2,...` as (normalised weight, path) pairs; a plain path (one
    that exists, or holds no `W:` prefix) is [(1.0, path)]."""
    parts = data.split(",")
    matched = [_WEIGHT.match(part) for part in parts]
    if Path(data).exists() or not all(matched):
        if any(matched) and len(parts) > 1 and not Path(data).exists():
            bad = next(p for p, m in zip(parts, matched, strict=True) if not m)
            raise ValueError(f"--data {data!r}: {bad!r} has no weight; a mixture is "
                             "W1:PATH1,W2:PATH2,... with weights above 0")
        return [(1.0, data)]
    pairs = [(float(m.group(1)), m.group(2).strip()) for m in matched if m]
    for weight, path in pairs:
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"--data: weight {weight:g} of {path!r} must be above 0")
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]
