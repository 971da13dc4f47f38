"""Exchange schedules as files: PyTorch's compute-only CSV and our own JSON.

CSV (the format of `torch.distributed.pipelining`'s `_dump_csv` / `_load_csv`,
`format="compute_only"`): one row per rank, one action per cell, global stage
indices, empty cells ignored (PyTorch writes its bubbles as empty cells):

    0F0,0F1,0F2,7F0,7I0,7W0,(0F3;7I1)OVERLAP_F_B,...

The placement is inferred from the rows (a stage lives on the one rank whose
row names it) and the microbatch count from the largest index unless given.
Everything a reader could get wrong is refused with one ValueError naming the
row and the cell (0-indexed, as PyTorch counts them): an unknown action, a
microbatch out of range, a backward before its forward (or a W before its
B), a pass run twice, a stage on two ranks, stages that run different
microbatches. What passes these checks then goes through `validate` for the
cross-rank faults (a dependency cycle, a braided block with dependent passes).

JSON is our IR written out: name, placement, microbatch count and the same
action strings per rank, one rank per line so a person can edit a schedule by
hand and run it. `load_json(dump_json(s)) == s` exactly, `meta` included as
long as it holds JSON values (lists come back as tuples, as generators store them).

Both readers take hostile input: the bounds of `stp.schedule.limits` (file
size, action count, rank count, stage and microbatch indices, JSON nesting)
are checked before the work or memory they bound is spent. A UTF-8 byte
order mark (as spreadsheets save CSV) and CRLF line ends are accepted; action
cells must be ASCII (`int` would read full-width digits as numbers).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from stp.schedule.csv_checks import check_cell, check_rows, csv_rows, where
from stp.schedule.ir import Action, Block, Kind, Pass, Schedule, passes_of
from stp.schedule.limits import (
    MAX_MICROBATCHES,
    MAX_RANKS,
    MAX_STAGES,
    bounded_text,
    brief,
    check_count,
    check_indices,
    json_value,
    read_source,
    shown,
)
from stp.schedule.validate import ScheduleError, validate

_T = TypeVar("_T")

__all__ = [
    "load_csv", "parse_csv", "dump_csv", "load_json", "parse_json", "dump_json", "JSON_FORMAT",
    "parse_action", "from_rows",
]

JSON_FORMAT = "stp-schedule"
"""Value of the `format` key of our JSON files."""
_JSON_VERSION = 1

# Action text is PyTorch's (Kind.B is its "I", Kind.BW its "B"): reading it is an
# exchange-format job, so this is the one place a letter becomes a Kind.
_PASS_RE = re.compile(r"^\s*(\d+)\s*(F|I|W|B)\s*(\d+)\s*$")
_BLOCK_RE = re.compile(r"^\s*\((.*)\)\s*OVERLAP_F_B\s*$")


def parse_action(text: str) -> Action:
    """Parse `0F3`, `2I1`, `1B0` or `(0F7;7I3)OVERLAP_F_B`. Raises ValueError."""
    m = _BLOCK_RE.match(text)
    if m:
        parts = [s for s in m.group(1).split(";") if s.strip()]
        passes = []
        for part in parts:
            p = parse_action(part)
            if isinstance(p, Block):
                raise ValueError(f"nested block in {text!r}")
            passes.append(p)
        return Block(tuple(passes))
    m = _PASS_RE.match(text)
    if not m:
        raise ValueError(
            f"unknown action {text!r}: expected STAGE KIND MICROBATCH with KIND one of "
            "F, I, W, B (e.g. '0F3', '2I1') or '(a;b)OVERLAP_F_B'"
        )
    return Pass(int(m.group(1)), Kind(m.group(2)), int(m.group(3)))


def from_rows(
    rows: Sequence[Sequence[str]],
    *,
    name: str = "custom",
    stage_to_rank: Sequence[int] | None = None,
    num_microbatches: int | None = None,
) -> Schedule:
    """A schedule from per-rank action strings (PyTorch's compute-only CSV rows).

    The placement is inferred from the rows when not given (each stage must
    appear on one rank only); the microbatch count is inferred as one more
    than the largest microbatch index when not given.
    """
    actions: list[tuple[Action, ...]] = []
    owner: dict[int, int] = {}
    max_mb = -1
    for r, row in enumerate(rows):
        acts = []
        for c, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                a = parse_action(cell)
            except ValueError as e:
                raise ValueError(f"row {r} (rank {r}), cell {c}: {e}") from None
            for p in passes_of(a):
                if owner.setdefault(p.stage, r) != r:
                    raise ValueError(
                        f"row {r} (rank {r}), cell {c}: stage {p.stage} of {cell!r} is "
                        f"already on rank {owner[p.stage]}; a stage lives on one rank"
                    )
                max_mb = max(max_mb, p.mb)
            acts.append(a)
        actions.append(tuple(acts))
    if stage_to_rank is None:
        if not owner:
            raise ValueError("no actions in the schedule")
        n = max(owner) + 1
        missing = [s for s in range(n) if s not in owner]
        if missing:
            raise ValueError(f"stages {missing} appear on no rank")
        stage_to_rank = [owner[s] for s in range(n)]
    m = num_microbatches if num_microbatches is not None else max_mb + 1
    return Schedule(
        name=name,
        num_ranks=len(rows),
        num_microbatches=m,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(actions),
    )


def load_csv(
    source: str | os.PathLike[str],
    *,
    num_microbatches: int | None = None,
    name: str | None = None,
    check: bool = True,
) -> Schedule:
    """Read PyTorch's compute-only CSV (a path, or the text itself) into a Schedule.

    `num_microbatches`, when given, must match the file; otherwise it is one
    more than the largest microbatch index. With `check` (default) the result
    is also run through `validate`. Raises ValueError naming row and cell.
    A str naming no existing file is taken for the text itself when it holds
    `,` or a newline; pass a Path to mean a file whatever its name, or call
    `parse_csv` to mean text.
    """
    text, stem = read_source(source, ".csv")
    return parse_csv(text, num_microbatches=num_microbatches, name=name or stem, check=check)


def parse_csv(
    text: str,
    *,
    num_microbatches: int | None = None,
    name: str | None = None,
    check: bool = True,
) -> Schedule:
    """`load_csv` of the CSV text itself (never a path)."""
    text = bounded_text(text)
    if num_microbatches is not None and not 1 <= num_microbatches <= MAX_MICROBATCHES:
        raise ValueError(f"num_microbatches={num_microbatches!r}: accepted are 1.."
                         f"{MAX_MICROBATCHES}")
    rows = csv_rows(text)
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            check_cell(r, c, cell)
        if not any(row):
            raise ValueError(f"row {r} (rank {r}) holds no actions; every rank needs a stage")
    # parses cells, infers the placement, refuses a stage on two ranks
    sch = from_rows(rows, name=name or "csv", num_microbatches=num_microbatches)
    cell_of = [[c for c, cell in enumerate(row) if cell] for row in rows]
    located = [
        list(zip(cols, acts, strict=True))
        for cols, acts in zip(cell_of, sch.actions, strict=True)
    ]
    check_rows(located, sch.num_microbatches)
    sch = replace(sch, meta={"source": "csv"})
    if check:
        try:
            validate(sch)
        except ScheduleError as e:
            if e.rank is None or e.position is None:
                raise
            prefix = f"rank {e.rank}, position {e.position} ({e.action}): "
            msg = str(e).removeprefix(prefix)
            raise ValueError(
                f"{where(e.rank, cell_of[e.rank][e.position])} ({e.action}): {msg}"
            ) from None
    return sch


def dump_csv(schedule: Schedule) -> str:
    """PyTorch's compute-only CSV of `schedule`: one row per rank, global stages.

    F, I (our B), W, B (our full backward BW) and `(a;b)OVERLAP_F_B` for a
    braided block, exactly as `torch.distributed.pipelining._Action` prints them.
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in schedule.rows():
        writer.writerow(row)
    return buf.getvalue()


def _tuples(value: object) -> object:
    """JSON lists back to tuples, as generators store them in `meta`."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _json_meta(meta: dict[str, object]) -> dict[str, object]:
    """The JSON-representable part of `meta` (keys as strings, values JSON types)."""
    out: dict[str, object] = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue  # e.g. an object a generator attached for itself; not part of the IR
        out[str(k)] = v
    return out


def dump_json(schedule: Schedule) -> str:
    """Our IR as JSON, one rank's action list per line (hand-editable)."""
    head = {
        "format": JSON_FORMAT,
        "version": _JSON_VERSION,
        "name": schedule.name,
        "num_ranks": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "stage_to_rank": list(schedule.stage_to_rank),
        "meta": _json_meta(schedule.meta),
    }
    lines = ["{"]
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "actions": [')
    rows = schedule.rows()
    for r, row in enumerate(rows):
        lines.append("    " + json.dumps(row) + ("," if r < len(rows) - 1 else ""))
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _need(obj: dict[str, object], key: str, kind: type[_T], what: str) -> _T:
    if key not in obj:
        raise ValueError(f"JSON schedule lacks {key!r} ({what})")
    val = obj[key]
    if not isinstance(val, kind) or (kind is int and isinstance(val, bool)):
        raise ValueError(f"JSON schedule: {key}={brief(val)} must be {what}")
    return val


def load_json(source: str | os.PathLike[str], *, check: bool = True) -> Schedule:
    """Read a schedule written by `dump_json` (a path, or the text itself).

    With `check` (default) the schedule is validated; errors name the rank and
    the index in its action list. A str naming no existing file is the text
    itself when it holds `{`; pass a Path to mean a file, or call
    `parse_json` to mean text.
    """
    text, _ = read_source(source, ".json")
    return parse_json(text, check=check)


def parse_json(text: str, *, check: bool = True) -> Schedule:
    """`load_json` of the JSON text itself (never a path)."""
    obj = json_value(bounded_text(text))
    if not isinstance(obj, dict) or obj.get("format") != JSON_FORMAT:
        raise ValueError(f'not an stp schedule: expected an object with "format": "{JSON_FORMAT}"')
    if obj.get("version") != _JSON_VERSION:
        raise ValueError(f"unsupported version {brief(obj.get('version'))}; this stp reads "
                         "version 1")
    name = _need(obj, "name", str, "a string")
    p = _need(obj, "num_ranks", int, "an integer >= 1")
    m = _need(obj, "num_microbatches", int, "an integer >= 1")
    placement = _need(obj, "stage_to_rank", list, "a list of ranks, one per stage")
    rows = _need(obj, "actions", list, "a list of per-rank action lists")
    for key, val, limit in (("num_ranks", p, MAX_RANKS),
                            ("num_microbatches", m, MAX_MICROBATCHES)):
        if val > limit:
            raise ValueError(f"JSON schedule: {key}={val} is beyond {limit}, the most read")
    if len(rows) > MAX_RANKS:
        raise ValueError(f"JSON schedule: actions holds {len(rows)} ranks' lists; at most "
                         f"{MAX_RANKS} are read")
    check_count(sum(len(r) if isinstance(r, list) else 1 for r in rows))
    if len(placement) > MAX_STAGES:
        raise ValueError(f"JSON schedule: stage_to_rank lists {len(placement)} stages; "
                         f"at most {MAX_STAGES} are read")
    # Files written before the `stp` offload policy fixed its chunk carry
    # offload_chunk, always 0; another value asks for what stp no longer does.
    chunk = obj.get("offload_chunk", 0)
    if type(chunk) is not int or chunk != 0:
        raise ValueError(f"JSON schedule: offload_chunk={brief(chunk)}: the stp offload policy "
                         "moves chunk 0 only; drop the key")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"JSON schedule: meta={brief(meta)} must be an object")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in placement):
        raise ValueError(f"JSON schedule: stage_to_rank={brief(placement)} must list integers")
    actions: list[tuple[Action, ...]] = []
    for r, row in enumerate(rows):
        if not isinstance(row, list) or not all(isinstance(a, str) for a in row):
            raise ValueError(f"JSON schedule: actions[{r}] must be a list of action strings")
        acts = []
        for i, a in enumerate(row):
            where = f"actions[{r}][{i}] (rank {r})"
            if not a.isascii():
                raise ValueError(f"{where}: {shown(a)} holds a non-ASCII character; actions "
                                 "are ASCII, e.g. '0F3' or '(0F7;7I3)OVERLAP_F_B'")
            check_indices(f"{where}: {shown(a)}", a)
            try:
                acts.append(parse_action(a))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        actions.append(tuple(acts))
    sch = Schedule(
        name=name,
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=tuple(placement),
        actions=tuple(actions),
        meta={k: _tuples(v) for k, v in meta.items()},
    )
    if check:
        validate(sch)  # ScheduleError names rank and position (= index in actions[rank])
    return sch
