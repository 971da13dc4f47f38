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
    # said while it compiled (off a terminal: a line before, one after), then the summary
    assert (0 <= out.stderr.index("compiling the model (--compile, first step)")
            < out.stderr.index(f"compiled in {steps[0]['compile_s']:.1f} s")
            < out.stderr.index("trained 2 steps")), out.stderr


def test_compile_with_emulated_stages_is_one_line(capsys) -> None:
    assert main(["train", "--compile", "--emulate-compute", "f=1,b=1,w=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--emulate-compute has no model to compile" in err, err


def test_compiling_is_said_before_the_first_step_line(capfd, monkeypatch, tmp_path) -> None:
    """Off a terminal: one line as the compiling first step starts, one with its
    seconds when it ends, both before step 1's progress line (compilation itself
    replaced by nothing: what is tested is where the lines go)."""
    import stp.train.run.setup

    monkeypatch.setattr(stp.train.run.setup, "compile_stages", lambda stages: None)
    assert main(["train", *TINY, "--compile", "--steps", "2", "--out", str(tmp_path)]) == 0
    err = capfd.readouterr().err.splitlines()
    starts = [i for i, line in enumerate(err) if line.startswith("compiling the model")]
    ends = [i for i, line in enumerate(err) if line.startswith("compiled in ")]
    step1 = next(i for i, line in enumerate(err) if line.startswith("step 1/2"))
    assert len(starts) == 1 and len(ends) == 1, err
    assert starts[0] < ends[0] < step1, err


def test_compiling_line_on_a_terminal_counts_seconds(capfd) -> None:
    from stp.cli.train_output import CompileProgress as _CompileProgress

    now = [100.0]
    progress = _CompileProgress(tty=True, every_s=3600, clock=lambda: now[0])
    progress(None)  # draws "0 s" at once; the redraws come every `every_s`
    now[0] = 112.4
    progress.tick()
    progress(12.4)
    err = capfd.readouterr().err
    assert err == ("\rcompiling the model (--compile, first step): 0 s\x1b[K"
                   "\rcompiling the model (--compile, first step): 12 s\x1b[K"
                   "\rcompiled in 12.4 s (--compile; the first step's time includes it)"
                   "\x1b[K\n"), repr(err)
