"""Time to first step: process start to the end of step 1, and where it went.

One definition, for stp and for anything compared with it: from the start of
the process the user started (`stp train`; under torchrun, each rank's own
process) to the end of the first optimizer step this process runs, data
loading included. Compile seconds are inside it and reported as their own
part, so a comparison can leave them out.

Parts, on global rank 0's timeline (each an interval of it, so they never sum
to more than the total; what falls between them is `other`):

- imports: process start to `stp train`'s own code (the interpreter, torch, stp);
- checks: the flags checked and resolved into a run (stp.train.run.job);
- workers: the workers started, imported and met (the process group, the mesh);
- data: the training and held-out data opened;
- build: the stages built and initialised, the optimizer and its buffers (less load);
- load: weights read from --init-from, or the checkpoint of --resume;
- compile: --compile's graphs compiled before the end of step 1 (stp.models.compile);
- step: step 1 itself, its batch included, less compile.

Another rank's slower build shows in rank 0's `step` (its first receive waits).
The launching process hands its marks to the workers in `ENV`, epoch seconds:
every worker of a local launch runs on the launcher's machine and clock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["ENV", "PARTS", "Startup", "line", "load_clock", "mark_launch", "process_start"]

ENV = "STP_STARTUP_MARKS"
"""process start, `stp train` entry, checks done: epoch seconds, comma-separated."""

PARTS = ("imports", "checks", "workers", "data", "build", "load", "compile", "step")


def process_start() -> float:
    """This process's start in epoch seconds: now less its age from the kernel's
    records on Linux (before the interpreter ran; to a clock tick), else the time this
    module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            # fields after the command name (which may hold spaces): field 22 is starttime
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def mark_launch(cli_entry: float) -> None:
    """Record, for this process and the workers it starts, when it started, when
    `stp train` began and that the checks are done (now)."""
    os.environ[ENV] = f"{process_start()!r},{cli_entry!r},{time.time()!r}"


@dataclass
class _Clock:
    """Seconds spent in one kind of work, summed (weights read during the build)."""

    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds

    def timed(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn`, its calls' seconds added here."""
        def call(*args: Any, **kwargs: Any) -> T:
            begun = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(time.perf_counter() - begun)
        return call


load_clock = _Clock()
"""Seconds this process spent reading weights (stp.train.run.setup times --init-from's
reads; the loop the --resume checkpoint's load)."""


@dataclass
class Startup:
    """Rank 0's marks, filled in as the run goes (`at`), turned into parts (`parts`)."""

    start: float
    cli: float
    launched: float
    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Startup:
        """The launcher's marks (ENV), or this process's own when it set none (a
        Trainer driven from Python: imports and checks then count as one)."""
        try:
            start, cli, launched = (float(v) for v in os.environ[ENV].split(","))
        except (KeyError, ValueError):
            start = process_start()
            cli = launched = time.time()
        return cls(start, cli, launched)

    def at(self, name: str) -> None:
        """Mark the end of part `name` now."""
        self.marks[name] = time.time()

    def parts(self, compile_s: float, compile_in_step: float) -> dict[str, float]:
        """Seconds of each part and `total` (to the `step` mark), `other` the rest.
        `compile_s`: compile seconds up to the end of step 1, of which `compile_in_step`
        ran inside the step (the rest inside the build)."""
        m = self.marks
        span = {
            "imports": self.cli - self.start,
            "checks": self.launched - self.cli,
            "workers": m["workers"] - self.launched,
            "data": m["data"] - m["workers"],
            "build": m["build"] - m["data"],
            "step": m["step"] - m["build"],
        }
        span = {k: max(0.0, v) for k, v in span.items()}  # clock steps of microseconds
        load = min(load_clock.seconds, span["build"])
        in_build = min(max(0.0, compile_s - compile_in_step), span["build"] - load)
        in_step = min(compile_in_step, span["step"])
        out = {
            "imports": span["imports"], "checks": span["checks"], "workers": span["workers"],
            "data": span["data"], "build": span["build"] - load - in_build, "load": load,
            "compile": in_build + in_step, "step": span["step"] - in_step,
        }
        total = max(m["step"] - self.start, sum(out.values()))
        out["other"] = total - sum(out.values())
        out["total"] = total
        return out


def line(parts: dict[str, float]) -> str:
    """The one start-up line a run prints."""
    inner = ", ".join(f"{k} {parts[k]:.2f}" for k in (*PARTS, "other"))
    return f"start-up: {parts['total']:.2f} s to the end of step 1 ({inner} s)"
