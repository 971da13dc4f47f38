"""Writing files so that a reader never sees half of one.

`replacing(path)` yields a temporary name in the same directory; when the
block ends without an error the temporary file is renamed over `path` (an
atomic step on POSIX), otherwise it is removed. A run killed or a disk that
fills up while writing therefore leaves the earlier good file in place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replacing", "write_text_atomic"]


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
