"""`stp train --arch mllm` resumes exactly: a pp2 run (the stp schedule: four
stages of one layer, the encoder's two blocks on both ranks; cosine schedule
with warm-up, clipping, float64) killed while rank 0 publishes its step-4 checkpoint
resumes from step 2 and repeats steps 2..5 with the step numbers, losses,
gradient norms and learning rates of a run never stopped, float for float
(as the decoder's resume test, tests/train/test_train_cli_resume.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stp.train.checkpoint import sharded as checkpoint

FLAGS = ["train", "--arch", "mllm", "--layers", "2", "--hidden", "32", "--heads", "4",
         "--seq-len", "12", "--vision-layers", "2", "--image-size", "8", "--patch", "2",
         "--vision-hidden", "8", "--microbatch-size", "1", "-m", "4",
         "--pp", "2", "--schedule", "stp",
         "--steps", "6", "--dtype", "float64", "--lr-schedule", "cosine", "--warmup", "2",
         "--clip-grad", "0.5", "--save-every", "2", "--timeout", "60"]

# Every process of the launched run (launcher and ranks) imports this first; the
# rank that publishes checkpoints (global rank 0) dies by SIGKILL once step 4's
# data and index are written but before its directory is renamed: a run killed
# mid-save, as a crash or an out-of-memory kill would leave it.
KILLER = """
import os
if os.environ.get("STP_TEST_KILL_AT"):
    import signal
    from stp.train.checkpoint import sharded as checkpoint

    publish = checkpoint._publish

    def killed_before_renaming(tmp, final, keep):
        if final.name == os.environ["STP_TEST_KILL_AT"]:
            os.kill(os.getpid(), signal.SIGKILL)
        publish(tmp, final, keep)

    checkpoint._publish = killed_before_renaming
"""


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                          text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _rows(stdout: str) -> list[dict]:
    return [r for r in map(json.loads, stdout.splitlines()) if "loss" in r]


def _killer_env(directory: Path) -> dict[str, str]:
    (directory / "sitecustomize.py").write_text(KILLER)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "STP_TEST_KILL_AT": checkpoint.checkpoint_name(4)}


@pytest.mark.slow
def test_mllm_run_killed_while_saving_resumes_exactly(tmp_path: Path) -> None:
    straight = _run([*FLAGS, "--json", "--out", str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr[-3000:]
    rows = _rows(straight.stdout)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[5]["loss"] < rows[0]["loss"]  # it trains
    assert rows[0]["lr"] < rows[1]["lr"] > rows[5]["lr"]  # warm-up, then cosine decay

    out, hook = tmp_path / "killed", tmp_path / "hook"
    hook.mkdir()
    killed = _run([*FLAGS, "--json", "--out", str(out)], env=_killer_env(hook))
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert [r["step"] for r in _rows(killed.stdout)][-1] < 6  # it never finished
    assert (out / f".{checkpoint.checkpoint_name(4)}.partial" / ".metadata").exists()
    assert checkpoint.latest(out).name == checkpoint.checkpoint_name(2)

    resumed = _run([*FLAGS, "--json", "--out", str(out), "--resume", str(out)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _rows(resumed.stdout)
    assert [r["step"] for r in again] == [3, 4, 5, 6]
    keys = ("loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows[2:]]
    assert checkpoint.latest(out).name == checkpoint.checkpoint_name(6)
