"""`stp train` as people run it: per-step JSON (loss, grad_norm, lr, tokens_per_s,
step_s), held-out evaluation, checkpoints every N steps, and a run killed
while a checkpoint is being written resuming from the previous complete one
with the same step numbers and the same losses as a run never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stp.train.checkpoint import sharded as checkpoint

TINY = ["train", "--pp", "1", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--seq-len", "16", "--microbatch-size", "1", "-m", "4", "--steps", "6",
        "--dtype", "float64", "--lr-schedule", "cosine", "--warmup", "2", "--clip-grad", "0.5",
        "--save-every", "2", "--eval-every", "3", "--timeout", "60"]

KILLER = """
import os, signal, sys
from stp.train.checkpoint import sharded as checkpoint

publish = checkpoint._publish

def killed_before_renaming(tmp, final, keep):
    # step 4's data and index are on disk, its name is not: SIGKILL here
    if final.name == "step-00000004":
        os.kill(os.getpid(), signal.SIGKILL)
    publish(tmp, final, keep)

checkpoint._publish = killed_before_renaming
from stp.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _run(argv: list[str], script: str | None = None) -> subprocess.CompletedProcess[str]:
    head = ["-c", script] if script else ["-m", "stp.cli.main"]
    return subprocess.run([sys.executable, *head, *argv], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _rows(stdout: str) -> list[dict]:
    return [r for r in map(json.loads, stdout.splitlines()) if "loss" in r]


@pytest.mark.slow
def test_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(Path(checkpoint.__file__).read_text())
    flags = [*TINY, "--eval-data", str(held_out)]
    straight = _run([*flags, "--json", "--out", str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr
    rows = _rows(straight.stdout)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_s"} <= set(r)
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_s"] > 0
    assert rows[0]["lr"] < rows[1]["lr"] > rows[5]["lr"]  # warm-up, then cosine decay
    assert [("eval_loss" in r) for r in rows] == [False, False, True, False, False, True]
    saved = [p.name for p in checkpoint.complete_checkpoints(tmp_path / "straight")]
    assert saved == ["step-00000002", "step-00000004", "step-00000006"]

    out = tmp_path / "killed"
    killed = _run([*flags, "--out", str(out)], script=KILLER)
    assert killed.returncode == -9, killed.stderr
    assert "eval" in killed.stderr  # the progress bar reports the held-out loss
    assert (out / ".step-00000004.partial" / ".metadata").exists()  # written, never named
    assert checkpoint.latest(out).name == "step-00000002"

    resumed = _run([*flags, "--json", "--out", str(out), "--resume", str(out)])
    assert resumed.returncode == 0, resumed.stderr
    again = _rows(resumed.stdout)
    assert [r["step"] for r in again] == [3, 4, 5, 6]
    keys = ("loss", "grad_norm", "lr", "eval_loss")
    assert [[r.get(k) for k in keys] for r in again] == [[r.get(k) for k in keys]
                                                          for r in rows[2:]]
    assert checkpoint.latest(out).name == "step-00000006"
