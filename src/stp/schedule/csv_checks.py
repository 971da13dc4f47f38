"""A compute-only CSV's rows checked where a reader can name the row and the
cell (0-indexed, as PyTorch counts them): what a cell may hold before it is
parsed (no communication action, ASCII, indices within the limits) and what
the parsed rows must keep (microbatches in range, no pass run twice, no
backward before its forward or W before its B, every stage running every
microbatch). stp.schedule.io reads the CSV through these."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence

from stp.schedule.ir import Action, Kind, passes_of
from stp.schedule.limits import MAX_RANKS, check_count, check_indices, shown

__all__ = ["check_cell", "check_rows", "csv_rows", "where"]

# Actions PyTorch's lowered ("compute_comms") CSV holds but a compute-only one must not.
_COMM_RE = re.compile(r"^\s*\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*\s*$")


def where(row: int, cell: int) -> str:
    """How an error names a cell: its row (the rank) and its index in the row."""
    return f"row {row} (rank {row}), cell {cell}"


def csv_rows(text: str) -> list[list[str]]:
    """The CSV's rows of stripped cells, trailing blank lines dropped."""
    try:
        rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text))]
    except csv.Error as e:  # a NUL byte, a cell over the csv module's field limit
        raise ValueError(f"not a readable CSV: {e}") from None
    while rows and not any(rows[-1]):
        rows.pop()  # trailing blank lines are not ranks
    if not rows:
        raise ValueError("the CSV holds no rows; expected one row of actions per rank")
    if len(rows) > MAX_RANKS:
        raise ValueError(f"the CSV holds {len(rows)} rows (ranks); at most {MAX_RANKS} are read")
    check_count(sum(1 for row in rows for cell in row if cell))
    return rows


def check_cell(r: int, c: int, cell: str) -> None:
    """Refuse, before anything is parsed or allocated, a communication action,
    a non-ASCII cell and a stage or microbatch index beyond the limits."""
    if not cell.isascii():
        raise ValueError(f"{where(r, c)}: {shown(cell)} holds a non-ASCII character; "
                         "actions are ASCII, e.g. '0F3' or '(0F7;7I3)OVERLAP_F_B'")
    if _COMM_RE.match(cell):
        raise ValueError(
            f"{where(r, c)}: {shown(cell)} is a communication/FSDP action; only a "
            "compute-only CSV is accepted (actions F, I, W, B and (a;b)OVERLAP_F_B)"
        )
    check_indices(f"{where(r, c)}: {shown(cell)}", cell)


_LABEL = {"F": "forward (F)", "B": "backward (I or B)", "W": "weight gradient (W or B)"}
_KIND_LABEL = {
    Kind.F: "forward", Kind.B: "input-gradient backward", Kind.W: "weight-gradient backward",
    Kind.BW: "full backward",
}
_PROVIDES = {Kind.F: ("F",), Kind.B: ("B",), Kind.W: ("W",), Kind.BW: ("B", "W")}


def check_rows(cells: Sequence[Sequence[tuple[int, Action]]], num_microbatches: int) -> None:
    """Per-row checks that can name the cell: microbatch range, a pass run
    twice, a backward before its forward, a W before its B, and every stage
    running every microbatch (consistent counts).

    A stage lives on one rank (checked before), so the order of one stage's
    passes is the order of that rank's row.
    """
    m = num_microbatches
    ran: dict[tuple[int, str, int], int] = {}  # (stage, F/B/W, mb) -> cell
    stage_row: dict[int, int] = {}
    for r, row in enumerate(cells):
        for c, action in row:
            for p in passes_of(action):
                stage_row[p.stage] = r
                if not 0 <= p.mb < m:
                    raise ValueError(
                        f"{where(r, c)}: microbatch {p.mb} of {p} is outside 0..{m - 1} "
                        f"(the schedule has {m} microbatches)"
                    )
                need = {Kind.B: "F", Kind.BW: "F", Kind.W: "B"}.get(p.kind)
                if need and (p.stage, need, p.mb) not in ran:
                    raise ValueError(
                        f"{where(r, c)}: {_KIND_LABEL[p.kind]} {p} comes before its "
                        + ("forward" if need == "F" else "input-gradient backward")
                        + f" {p.stage}{'F' if need == 'F' else 'I'}{p.mb}"
                    )
                for k in _PROVIDES[p.kind]:
                    if (p.stage, k, p.mb) in ran:
                        raise ValueError(
                            f"{where(r, c)}: {p} repeats the {_LABEL[k]} of stage {p.stage}, "
                            f"microbatch {p.mb}, already run at cell {ran[(p.stage, k, p.mb)]}"
                        )
                    ran[(p.stage, k, p.mb)] = c
    runs: dict[tuple[int, str], int] = {}
    for s, k, _ in ran:
        runs[(s, k)] = runs.get((s, k), 0) + 1
    for s in sorted(stage_row):
        r = stage_row[s]
        for k in ("F", "B", "W"):
            count = runs.get((s, k), 0)
            if count != m:
                raise ValueError(
                    f"row {r} (rank {r}): inconsistent microbatch counts: stage {s} runs "
                    f"{count} {_LABEL[k]} passes, expected {m} (microbatches "
                    f"0..{m - 1}); missing microbatch {_first_missing(ran, s, k, m)}"
                )


def _first_missing(ran: dict[tuple[int, str, int], int], stage: int, k: str, m: int) -> str:
    """Up to eight missing microbatches, in bounded time: the search stops
    after them, and the first is at most the number of passes present."""
    missing: list[int] = []
    for i in range(m):
        if (stage, k, i) not in ran:
            missing.append(i)
            if len(missing) > 8:
                break
    return ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
