"""`stp train --schedule FILE` and `--partition`: a schedule `stp search` wrote
and an uneven layer partition train with the losses of one process (float64,
1e-9, as test_train_cli.py), and bad input is refused before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stp.cli.main import main
from stp.schedule import io
from stp.schedule.ir import Block

TINY = ["--layers", "6", "--hidden", "32", "--heads", "4", "--seq-len", "16",
        "--microbatch-size", "1", "--steps", "2", "--timeout", "60", "--dtype", "float64"]
M = 4


def _losses(argv: list[str], out: Path) -> list[float]:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *TINY, "--json", *argv,
           "--out", str(out)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert got.returncode == 0, got.stderr[-3000:]
    return [r["loss"] for r in map(json.loads, got.stdout.splitlines()) if "loss" in r]


def _found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A braided V schedule for p=2 from `stp search --out`."""
    path = tmp_path / "found.json"
    assert main(["search", "--pp", "2", "-m", str(M), "--cost", "f=2,b=2,w=2,ar=1.5",
                 "--memory-limit", "3", "--braided", "on", "--placement", "v",
                 "--time-limit", "600", "--max-evaluations", "50", "--out", str(path)]) == 0
    capsys.readouterr()
    sch = io.load_json(path)
    assert any(isinstance(a, Block) for acts in sch.actions for a in acts)
    return path


@pytest.mark.slow
def test_found_schedule_and_uneven_partition_train_as_one_process(tmp_path, capsys):
    found = _found(tmp_path, capsys)
    ref = _losses(["--pp", "1", "-m", str(M)], tmp_path / "one")
    runs = {
        "found p2 tp2": ["--pp", "2", "--tp", "2", "--schedule", str(found)],
        "partition 1,3,2": ["--pp", "3", "--schedule", "1f1b", "-m", str(M),
                            "--partition", "1,3,2"],
    }
    for name, argv in runs.items():
        got = _losses(argv, tmp_path / name.replace(" ", "-"))
        assert len(got) == len(ref) == 2
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) <= 1e-9, name


@pytest.mark.parametrize("argv, needle", [
    (["--pp", "2", "--schedule", "1f1b", "--partition", "1,2"],
     "--partition 1,2 sums to 3 layers but the model has 6"),
    (["--pp", "2", "--schedule", "1f1b", "--partition", "6,0"], "stage 1 has 0 layers"),
    (["--pp", "2", "--schedule", "zb-v", "--partition", "3,3"],
     "names 2 stages but the schedule has 4 global stages"),
    (["--pp", "2", "--partition", "a,b"], "give auto or layer counts"),
    (["--pp", "2", "--schedule", "nope.json"], "--schedule nope.json: "),
])
def test_bad_partition_or_schedule_file_exits_2_in_one_line(argv, needle, capsys, tmp_path,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_a_schedule_file_that_does_not_fit_the_mesh_exits_2(tmp_path, capsys):
    found = _found(tmp_path, capsys)  # p=2, V: 4 stages
    for argv, needle in (
        (["--pp", "3"], "has 2 pipeline ranks but --pp is 3"),
        (["--pp", "2", "-m", "6"], f"runs {M} microbatches but -m is 6"),
        (["--pp", "2", "--layers", "3"], "fewer than the schedule's 4 stages"),
    ):
        assert main(["train", *TINY, "--schedule", str(found), *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
