"""How `stp train` stops when something goes wrong: one true line, a prompt exit.

* Interrupts. SIGINT or SIGTERM, to the command or to its whole process
  group, ends every rank at once, even one blocked in a receive
  (stp.runtime.watch); global rank 0 prints `stp: interrupted at step N`
  (N: steps done) and the last checkpoint written, and the command exits
  130 (SIGTERM: 143) without a traceback and without leaving a process.
* A failing rank prints one line naming itself, the action and the peer,
  and exits 1 if it failed by itself, 3 (EXIT_PEER) if it only waited on a
  peer that timed out or went away; one that timed out also names the
  ranks whose heartbeat stopped (frozen). The local launcher's last line
  names the rank the failure started at and how it ended
  (stp.runtime.launch.diagnose).
* Under torchrun the settings every node must share are compared before
  the ranks meet (stp.runtime.agree); rank 0 picks the run directory.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from stp.train.run.config import TrainJob

__all__ = ["StepTracker", "say", "interrupt_printer", "shared_settings", "rank_failure_line",
           "rank_namer", "launch_failure_line"]


class StepTracker:
    """Rank 0's step callback around the printer: remembers the steps done and the
    last checkpoint, for the interrupt line."""

    def __init__(self, printer: Callable[[Any], None]) -> None:
        self.printer = printer
        self.done = 0
        self.checkpoint: str | None = None

    def __call__(self, report: Any) -> None:
        self.done = report.step + 1
        self.checkpoint = report.checkpoint or self.checkpoint
        self.printer(report)

    def interrupted(self) -> str:
        if self.done == 0:
            return "stp: interrupted before the first step"
        saved = f"last checkpoint: {self.checkpoint}" if self.checkpoint else "no checkpoint yet"
        return f"stp: interrupted at step {self.done}; {saved}"


def say(line: str) -> None:
    """One line on stderr in one write: ranks sharing a terminal then never cut
    each other's lines (print writes the text and the newline separately)."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())


def interrupt_printer(tracker: StepTracker, *, bar: bool) -> Callable[[int], None]:
    """What rank 0 does on SIGINT/SIGTERM before it exits: one line on stderr,
    written straight to the file descriptor (the main thread may hold the
    stream's lock), after a newline when a progress bar is drawn in place."""

    def on_signal(signum: int) -> None:
        start = "\n" if bar and sys.stderr.isatty() else ""
        os.write(2, (start + tracker.interrupted() + "\n").encode())  # no flush: see above

    return on_signal


def _flags(obj: Any) -> Iterator[tuple[str, str, Any]]:
    """(field name, flag, value) of every option of a settings dataclass, nested ones
    included (stp.cli.flags spells the flags the same way)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _flags(value)
        elif "help" in f.metadata:
            yield f.name, f.metadata.get("flag") or "--" + f.name.replace("_", "-"), value


def shared_settings(job: TrainJob) -> dict[str, str]:
    """The settings every rank must share, flag -> value, in --help order.

    Not compared: --out (rank 0 chooses and shares it), the paths of the
    data (nodes may mount them elsewhere: their sizes are compared) and of
    the trace (whether there is one is)."""
    from stp.train.data.corpus import open_corpus

    out: dict[str, str] = {}
    for name, flag, value in _flags(job):
        if name == "out":
            continue
        if name in ("data", "eval_data") and value is not None:
            try:
                value = f"{open_corpus(value).size} bytes"
            except ValueError:
                value = "missing"
        elif name == "trace":
            value = value is not None
        out[flag] = ("on" if value else "off") if isinstance(value, bool) else str(value)
    return out


def rank_failure_line(err: BaseException, heartbeat: Any) -> str:
    """The line a failing rank prints: its error, and for a timeout the ranks whose
    heartbeat stopped (the frozen ones everybody waits on)."""
    from stp.runtime.errors import CommTimeout, PeerLost, RankError, first_line
    from stp.runtime.watch import SILENCE_S

    text = str(err) if isinstance(err, RankError | ValueError) else (
        f"rank {os.environ.get('RANK', '0')}: {first_line(err)}")
    if isinstance(err, CommTimeout) and not isinstance(err, PeerLost) and heartbeat is not None:
        silent = heartbeat.silent_ranks()
        if silent:
            ranks = (f"global rank {silent[0]}" if len(silent) == 1
                     else "global ranks " + ", ".join(str(r) for r in silent))
            text += f"; {ranks} sent no heartbeat in the last {SILENCE_S:g} s: frozen or stopped"
    return f"stp: error: {text}"


def rank_namer(job: TrainJob) -> Callable[[int], str]:
    """`rank 3 (pp 1, tp 1, dp 0)`: a global rank with its mesh coordinates."""
    from stp.runtime.mesh import ParallelDims

    dims = ParallelDims(job.pp, job.tp, job.dp, job.ep)

    def name(rank: int) -> str:
        c = dims.coord_of(rank)
        return f"rank {rank} (pp {c.pp}, tp {c.tp}, dp {c.dp})"

    return name


def launch_failure_line(result: Any) -> str:
    """The launcher's last line: the rank the failure started at and how it ended
    (result: stp.runtime.launch.LaunchResult)."""
    return f"stp: error: training stopped: {result.cause}; the other ranks were stopped"
