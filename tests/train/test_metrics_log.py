"""Every run writes metrics.jsonl in its run directory (the `--json` step objects),
continued on --resume with the lines after the checkpoint dropped; `--log
tensorboard` also writes TensorBoard event files, read back here with
TensorBoard's own reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stp.train.run.metrics import MetricsLog, check_log

TINY = ["train", "--pp", "1", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--seq-len", "16", "--microbatch-size", "1", "-m", "2", "--steps", "4",
        "--dtype", "float64", "--lr-schedule", "cosine", "--warmup", "1",
        "--save-every", "2", "--timeout", "60"]


def _train(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_metrics_jsonl_and_tensorboard_continue_a_resumed_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    first = _train([*TINY, "--json", "--log", "tensorboard", "--out", str(out)])
    assert first.returncode == 0, first.stderr
    printed = [r for r in map(json.loads, first.stdout.splitlines()) if "loss" in r]
    written = _lines(out / "metrics.jsonl")
    assert written == printed  # the file holds exactly what --json printed
    assert [r["step"] for r in written] == [1, 2, 3, 4]
    board = _scalars(out, "train/loss")
    assert [s for s, _ in board] == [1, 2, 3, 4]
    assert [v for _, v in board] == pytest.approx([r["loss"] for r in written], rel=1e-6)

    # an interrupted run: it wrote steps 3 and 4, but its last checkpoint is step 2
    shutil.rmtree(out / "step-00000004")
    resumed = _train([*TINY, "--log", "tensorboard", "--out", str(out), "--resume", str(out)])
    assert resumed.returncode == 0, resumed.stderr
    again = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3, 4]  # each step once
    assert again[:2] == written[:2]
    assert [r["loss"] for r in again[2:]] == pytest.approx([r["loss"] for r in written[2:]],
                                                          rel=1e-12)
    assert [s for s, _ in _scalars(out, "train/loss")] == [1, 2, 3, 4]  # purged, then 3, 4


def test_a_cut_short_line_goes_with_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    log = MetricsLog(tmp_path, resumed_at=2, tensorboard=False)
    log.close()
    assert _lines(tmp_path / "metrics.jsonl") == rows[:2]
    MetricsLog(tmp_path, resumed_at=0, tensorboard=False).close()  # a new run starts afresh
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_log_values_are_checked_before_any_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--log 'wandb': expected one of jsonl, tensorboard"):
        check_log("wandb")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'stp\[log\]'"):
        check_log("tensorboard")


def test_an_oversized_metrics_file_is_refused_not_read(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from stp.train.run import metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n' * 10)
    monkeypatch.setattr(metrics, "MAX_METRICS_BYTES", 100)
    with pytest.raises(ValueError, match="more than a metrics file holds"):
        MetricsLog(tmp_path, resumed_at=1, tensorboard=False)
    assert (tmp_path / "metrics.jsonl").stat().st_size == 250  # left as it was
