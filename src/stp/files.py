"""Writing files so that a reader never sees half of one.

`replacing(path)` yields a temporary name in the same directory; when the
block ends without an error the temporary file is renamed over `path` (an
atomic step on POSIX), otherwise it is removed. A run killed or a disk that
fills up while writing therefore leaves the earlier good file in place.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["read_json", "read_json_object", "replacing", "write_text_atomic"]


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path: str | os.PathLike[str], max_bytes: int) -> Any:
    """The JSON document in file `path`, read in bounded memory (at most
    `max_bytes` + 1 bytes; a UTF-8 BOM is accepted). ValueError naming the
    file when it cannot be read, is too large, or is not JSON."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise ValueError(f"{str(path)!r} is larger than {max_bytes >> 20} MiB")
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{str(path)!r} is not JSON: {str(e)[:80]}") from None


def read_json_object(path: str | os.PathLike[str], max_bytes: int = 16 << 20) -> dict[str, Any]:
    """`read_json` of a file that must hold one JSON object (config.json, stp.json):
    a list, a number or binary data is refused in one line naming the file."""
    value = read_json(path, max_bytes)
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(value), "a number")
        raise ValueError(f"{str(path)!r} holds {kind}, not a JSON object of settings")
    return value
