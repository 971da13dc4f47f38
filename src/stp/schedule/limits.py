"""Bounds on what the schedule readers (`stp.schedule.io`) accept.

A schedule file may come from anywhere, so each limit is checked before the
work or memory it bounds is spent: a file is read up to `MAX_FILE_BYTES`, its
actions are counted before any is parsed, an index is checked before the
tables it sizes are built (a 100-byte file naming microbatch 99999999999
would otherwise take 4 GB), and JSON nesting is bounded. Every refusal is a
ValueError naming the value and what is accepted. The CLI builds its flag
maxima on the same numbers (`stp.cli.common`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = [
    "MAX_ACTIONS", "MAX_FILE_BYTES", "MAX_JSON_DEPTH", "MAX_MICROBATCHES", "MAX_RANKS",
    "MAX_STAGES", "read_source", "bounded_text", "check_count", "check_indices", "json_value",
    "brief", "shown",
]

MAX_RANKS = 64
"""Most pipeline ranks (CSV rows, JSON `num_ranks`) a schedule may have."""
MAX_STAGES = 1024
"""Stage indices stay below this: 64 ranks times 16 chunks."""
MAX_MICROBATCHES = 4096
"""Microbatch indices (and counts) stay below (at most) this."""
MAX_FILE_BYTES = 4 * 2**20
"""Largest schedule file read (4 MiB). A schedule within the CLI's work limit
(stages x microbatches <= 32768, so at most 98304 passes) takes about 1 MiB;
a whole `stp simulate` reading 4 MiB of the smallest cells peaks near 200 MB."""
MAX_ACTIONS = 2**17
"""Most actions (non-empty cells) read, counted before any is parsed: a
schedule within the CLI's work limit has at most 98304. Reading and
validating 131072 takes about 2 s."""
MAX_JSON_DEPTH = 32
"""Deepest JSON nesting read; a schedule needs 3 (object, actions, a rank's list)."""


def read_source(source: str | os.PathLike[str], suffix: str) -> tuple[str, str | None]:
    """(text, file stem or None). A Path is always a file. A str naming an
    existing file is read; any other str is the content itself, except that
    a single line without `,` or `{` that ends in `suffix` or holds a path
    separator (no action string has one) is a path that does not exist."""
    if isinstance(source, os.PathLike) or _is_file(source):
        path = Path(source)
    elif "\n" in source or "," in source or "{" in source:
        return bounded_text(source), None
    elif source.strip().lower().endswith(suffix) or "/" in source or os.sep in source:
        path = Path(source)
    else:
        return bounded_text(source), None
    return _read_file(path), path.stem


def bounded_text(source: str) -> str:
    """Schedule text given as a str, bounded as a file is; a byte order mark dropped."""
    if len(source) > MAX_FILE_BYTES:
        raise ValueError(f"the schedule text holds {len(source)} characters; at most "
                         f"{MAX_FILE_BYTES} are read")
    return source.removeprefix("\ufeff")


def _is_file(text: str) -> bool:
    try:
        return len(text) < 4096 and os.path.isfile(text)
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def _read_file(path: Path) -> str:
    """The file's text, read in bounded memory: at most MAX_FILE_BYTES + 1 bytes."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"no such file: {str(path)!r}") from None
    except OSError as e:
        raise ValueError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(
            f"{str(path)!r} is larger than {MAX_FILE_BYTES // 2**20} MiB, the largest schedule "
            "file read (a schedule within stp's limits takes about 1 MiB)"
        )
    try:
        # utf-8-sig drops a byte order mark; universal newlines as Path.read_text
        return data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"cannot read {str(path)!r}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None


def brief(value: object) -> str:
    """repr of a value from a file, cut short: a message stays one short line."""
    text = ascii(value)
    return text if len(text) <= 60 else text[:60] + "..."


def shown(cell: str) -> str:
    """A cell as messages quote it: ASCII, and cut short when long."""
    return ascii(cell if len(cell) <= 40 else cell[:40] + "...")


def check_count(num_actions: int) -> None:
    if num_actions > MAX_ACTIONS:
        raise ValueError(f"the schedule holds {num_actions} actions; at most {MAX_ACTIONS} are "
                         "read")


# A pass inside an action: STAGE KIND MICROBATCH (the action is checked ASCII first).
_PASS_IN_ACTION = re.compile(r"(\d+)\s*[FIWB]\s*(\d+)")


def check_indices(where: str, action: str) -> None:
    """Refuse a stage or microbatch index of `action` beyond the limits."""
    for found in _PASS_IN_ACTION.finditer(action):
        for text, what, limit in ((found[1], "stage", MAX_STAGES),
                                  (found[2], "microbatch", MAX_MICROBATCHES)):
            # the length first: int() of a long digit string is itself work
            if len(text) > 9 or int(text) >= limit:
                raise ValueError(f"{where}: {what} index {shown(text)} is outside "
                                 f"0..{limit - 1}, the indices read")


def _refuse_constant(name: str) -> object:
    raise ValueError(f"not valid JSON: {name} is not a JSON number")


def json_value(text: str) -> object:
    """json.loads, with every failure a ValueError and nesting bounded."""
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # nesting deeper than the interpreter's stack allows
        raise ValueError(f"not valid JSON for a schedule: nested deeper than "
                         f"{MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    except ValueError as e:  # a number longer than int() reads, NaN, Infinity
        raise ValueError(str(e) if str(e).startswith("not valid JSON") else
                         f"not valid JSON for a schedule: {e}") from None
    _check_depth(obj)
    return obj


def _check_depth(obj: object) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH (walked without recursion)."""
    todo: list[tuple[object, int]] = [(obj, 1)]
    while todo:
        value, depth = todo.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"not valid JSON for a schedule: nested deeper than "
                             f"{MAX_JSON_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value
        todo.extend((child, depth + 1) for child in children)
