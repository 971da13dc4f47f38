"""Time to first step (stp.train.run.startup): the parts against marks set by hand, and
the one start-up line of a real `stp train` run against the test's own clock."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stp.train.run import startup
from stp.train.run.startup import PARTS, Startup

FIELDS = {*PARTS, "other", "total"}


def test_parts_are_the_intervals_between_the_marks(monkeypatch):
    monkeypatch.setattr(startup.load_clock, "seconds", 1.5)
    clock = Startup(start=100.0, cli=102.0, launched=102.5)
    clock.marks = {"workers": 106.0, "data": 106.25, "build": 110.0, "step": 115.0}
    got = clock.parts(compile_s=3.0, compile_in_step=2.0)
    # by hand: build 3.75 s less 1.5 s of reads less 1 s compiled before the step;
    # step 5 s less its 2 s of compiling
    want = {"imports": 2.0, "checks": 0.5, "workers": 3.5, "data": 0.25, "build": 1.25,
            "load": 1.5, "compile": 3.0, "step": 3.0, "other": 0.0, "total": 15.0}
    assert got == pytest.approx(want)


def test_what_no_mark_covers_is_other(monkeypatch):
    monkeypatch.setattr(startup.load_clock, "seconds", 0.0)
    clock = Startup(start=0.0, cli=1.0, launched=1.0)
    clock.marks = {"workers": 2.0, "data": 2.0, "build": 3.0, "step": 4.0}
    got = clock.parts(compile_s=0.0, compile_in_step=0.0)
    assert got["total"] == 4.0 and got["other"] == pytest.approx(0.0)
    assert sum(got[k] for k in (*PARTS, "other")) == pytest.approx(got["total"])


def test_this_process_started_before_now_and_not_long_ago():
    began = startup.process_start()
    assert began <= time.time()
    assert time.time() - began < 24 * 3600  # a test session, not the machine's boot


def test_a_run_prints_one_startup_line_and_json_records_it(tmp_path: Path):
    argv = ["train", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16",
            "--microbatch-size", "1", "-m", "2", "--steps", "2", "--pp", "1",
            "--schedule", "1f1b", "--timeout", "120", "--out", str(tmp_path / "run"), "--json"]
    before = time.time()
    out = subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ))
    after = time.time()
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert "startup" in steps[0] and all("startup" not in r for r in steps[1:])
    parts = steps[0]["startup"]
    assert set(parts) == FIELDS
    assert all(isinstance(v, float) and v >= 0 for v in parts.values()), parts
    assert sum(parts[k] for k in (*PARTS, "other")) <= parts["total"] + 1e-6
    # process start to the end of step 1: within the test's own view of the process
    # (its start is read to a clock tick), and at least the first step itself
    assert parts["step"] + parts["compile"] >= steps[0]["step_s"] - 1e-3
    assert parts["total"] <= after - before + 0.05
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("start-up:")]
    assert len(lines) == 1
    shown = dict(re.findall(r"(\w+) (\d+\.\d+)", lines[0].split("(", 1)[1]))
    assert set(shown) == FIELDS - {"total"}
    assert float(lines[0].split()[1]) == pytest.approx(parts["total"], abs=0.006)
    for k, v in shown.items():
        assert float(v) == pytest.approx(parts[k], abs=0.006)
