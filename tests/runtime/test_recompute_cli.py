"""`stp train --recompute`: full recomputation trains (two steps on two pipeline ranks,
with the resident activation bytes reported), a value outside none / selective /
full is refused by the flag's choices (exit 2, one line naming them), and so is
recomputation of emulated stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stp.cli.main import main

TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16",
        "--microbatch-size", "1", "-m", "4", "--timeout", "60"]


def test_stp_train_recompute_full_runs(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *TINY, "--recompute", "full",
           "--steps", "2", "--offload", "none", "--json", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(x > 0 for x in losses)
    assert "peak resident activations per rank" in out.stderr, out.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--recompute", "half"], "argument --recompute: invalid choice: 'half' (choose from "
                              "'none', 'selective', 'full')"),
    (["--recompute", "full", "--emulate-compute", "f=1,b=1,w=1"],
     "--emulate-compute has no activations to recompute"),
])
def test_bad_recompute_is_one_line(argv: list[str], needle: str, capsys) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_the_pre_launch_memory_estimate_prices_the_recompute_mode() -> None:
    """`stp train` refuses a run that cannot fit from the cost model's estimate
    (stp.train.run.memory_check): it prices the job's --recompute, so full recomputation
    lets a run through that would not fit without it."""
    import dataclasses

    from stp.train.run.config import ModelShape, TrainJob
    from stp.train.run.memory_check import run_estimate
    from stp.train.run.resolve import resolve

    job = TrainJob(model=ModelShape(layers=4, hidden=32, heads=4, seq_len=16), tp=2,
                   microbatch_size=1)
    peaks = {mode: [r.activations_peak for r in run_estimate(resolve(
        dataclasses.replace(job, recompute=mode))).ranks]
        for mode in ("none", "selective", "full")}
    for none, sel, full in zip(peaks["none"], peaks["selective"], peaks["full"], strict=True):
        # the runtime's attention is a flash kernel: it keeps no scores for selective to drop
        assert full < sel <= none, peaks
