"""Where a run's step figures go besides the terminal: `metrics.jsonl` in the run
directory, always, and TensorBoard event files with `--log tensorboard`.

Each line of `metrics.jsonl` is the object `stp train --json` prints for a step
(`step_row`), so one reader serves both. A resumed run continues the file of the
run directory it writes to: the lines after the checkpoint's step (written by the
interrupted run after its last checkpoint) are dropped first, so every step
appears once and the file reads as one run. Only global rank 0 writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

__all__ = ["METRICS_FILE", "TENSORBOARD_DIR", "MetricsLog", "step_row", "check_log"]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LOGS = ("jsonl", "tensorboard")
"""--log choices: metrics.jsonl is written either way; tensorboard adds event files."""

_SCALARS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_s", "mfu",
            "aux_loss")
"""The figures TensorBoard gets, under train/<name> (eval_loss under eval/loss)."""


class StepFigures(Protocol):
    """What a row is made of (stp.train.run.loop.StepReport, a frozen dataclass:
    read-only members)."""

    @property
    def step(self) -> int: ...
    @property
    def loss(self) -> float: ...
    @property
    def tokens_per_s(self) -> float: ...
    @property
    def step_time_s(self) -> float: ...
    @property
    def resident_activation_bytes(self) -> list[int] | None: ...
    @property
    def grad_norm(self) -> float | None: ...
    @property
    def lr(self) -> float | None: ...
    @property
    def skipped(self) -> bool: ...
    @property
    def eval_loss(self) -> float | None: ...
    @property
    def figures(self) -> dict[str, float] | None: ...
    @property
    def compile_s(self) -> float | None: ...
    @property
    def mfu(self) -> float | None: ...
    @property
    def startup(self) -> dict[str, float] | None: ...


def step_row(r: StepFigures) -> dict[str, Any]:
    """One step as `--json` prints it and `metrics.jsonl` stores it. `step` counts
    from 1, as the progress line and the checkpoint names count."""
    row: dict[str, Any] = {
        "step": r.step + 1, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
        "tokens_per_s": r.tokens_per_s, "step_s": r.step_time_s,
        "resident_activation_bytes": r.resident_activation_bytes}
    if r.skipped:
        row["skipped"] = True
    if r.eval_loss is not None:
        row["eval_loss"] = r.eval_loss
    if r.compile_s is not None:
        row["compile_s"] = r.compile_s
    row["mfu"] = r.mfu  # null: the device's peak is unknown
    row.update(r.figures or {})  # e.g. an MoE's aux_loss
    if r.startup is not None:
        row["startup"] = r.startup
    return row


def check_log(log: str) -> None:
    """--log's value, and the package it needs, before any worker starts."""
    if log not in LOGS:
        raise ValueError(f"--log {log!r}: expected one of {', '.join(LOGS)}")
    if log == "tensorboard":
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--log tensorboard needs the tensorboard package: "
                             "pip install 'stp[log]' (or drop --log)")


MAX_METRICS_BYTES = 1 << 30
"""A metrics file a resume continues is read whole: larger than this (about three
million steps) it is refused rather than read."""


def _kept_lines(path: Path, through_step: int) -> list[str]:
    """The lines of an earlier run's metrics.jsonl up to `through_step` (the
    checkpoint resumed from). A line that is not a step object (cut short by a
    kill mid-write, say) is dropped with the steps after the checkpoint."""
    size = path.stat().st_size
    if size > MAX_METRICS_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than a metrics file holds "
                         f"({MAX_METRICS_BYTES} at most); move it aside to resume")
    kept = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and step <= through_step:
                kept.append(json.dumps(row) + "\n")
    return kept


class MetricsLog:
    """Rank 0's writer of one run's figures (see the module doc)."""

    def __init__(self, run_dir: str | Path, *, resumed_at: int, tensorboard: bool) -> None:
        """`resumed_at`: the steps done before this process's first (0: a new run,
        which starts the file afresh)."""
        self.path = Path(run_dir) / METRICS_FILE
        kept = _kept_lines(self.path, resumed_at) if resumed_at and self.path.is_file() else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)  # the old file stays whole until the new one is
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events an interrupted run wrote after
            # the checkpoint, as metrics.jsonl drops its lines
            self._tb = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR),
                                     purge_step=resumed_at + 1 if resumed_at else None)

    def write(self, r: StepFigures) -> None:
        row = step_row(r)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()  # a dashboard tailing the file sees each step as it ends
        if self._tb is not None:
            for name in _SCALARS:
                value = row.get(name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    tag = "eval/loss" if name == "eval_loss" else f"train/{name}"
                    self._tb.add_scalar(tag, value, row["step"])
            self._tb.flush()  # a run killed later keeps its steps, as metrics.jsonl does

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
