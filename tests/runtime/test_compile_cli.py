"""`stp train --compile`: trains on one process with the compile seconds reported
apart from the step time (`compile_s` in every --json step object, positive in
the first step, 0 in the second: nothing recompiles; summed in the closing
object and the human summary), and emulated stages refuse it in one line,
exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stp.cli.main import main

TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16",
        "--microbatch-size", "1", "-m", "2", "--timeout", "300", "--pp", "1",
        "--schedule", "1f1b"]


def test_stp_train_compile_reports_compile_seconds_apart(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *TINY, "--compile",
           "--steps", "2", "--json", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(r["loss"] > 0 for r in steps)
    assert 0 < steps[0]["compile_s"] <= steps[0]["step_s"]
    assert steps[1]["compile_s"] == 0.0  # static shapes: the second step compiles nothing
    summary = next(r for r in rows if r.get("summary"))
    assert summary["compile_s"] == steps[0]["compile_s"]
    assert "s compiling, inside the first step" in out.stderr, out.stderr


def test_compile_with_emulated_stages_is_one_line(capsys) -> None:
    assert main(["train", "--compile", "--emulate-compute", "f=1,b=1,w=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--emulate-compute has no model to compile" in err, err
