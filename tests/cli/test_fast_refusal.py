"""A command line whose mistake the flags alone show is refused before torch loads
(stp.train.run.precheck): one line, exit 2, `torch` never imported, for `stp train` and
for `stp memory` pricing a train command line; and the early refusal says what the
full checks (stp.train.run.job, which import torch) say of the same flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stp.cli.flags import from_args
from stp.cli.main import build_parser
from stp.train.run.job import check
from stp.train.run.precheck import precheck

SRC = str(Path(__file__).resolve().parents[2] / "src")

BAD = [
    (["--tp", "3"], "--heads 4 must be divisible by --tp 3"),
    (["--tp", "3", "--heads", "6", "--hidden", "48"],
     "the MLP width (from --hidden) 128 must be divisible by --tp 3"),
    (["--tp", "2", "--kv-heads", "3", "--heads", "6", "--hidden", "48"],
     "--kv-heads 3 must be divisible by --tp 2, or divide it"),
    (["--arch", "moe", "--tp", "3"], "--heads 4 must be divisible by --tp 3"),
    (["--data", "/nonexistent/c.txt"], "data path '/nonexistent/c.txt' does not exist"),
    (["--eval-every", "1", "--eval-data", "/nonexistent/e.txt"],
     "data path '/nonexistent/e.txt' does not exist"),
    (["--dp", "2", "--ep", "3", "--arch", "moe"], "--ep 3 must divide --dp 2"),
    (["--lr", "0.003", "--lr-schedule", "cosine", "--min-lr", "1"],
     "--min-lr 1 is above --lr 0.003"),
    (["--init-from", "/nonexistent/model"],
     "checkpoint directory '/nonexistent/model' does not exist"),
]


def _job(argv: list[str]):
    from stp.train.run.config import TrainJob

    return from_args(TrainJob, build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("argv,message", BAD)
def test_early_refusal_reads_as_the_full_checks(argv, message) -> None:
    """The independent reference: stp.train.run.job.check, which builds the model's config
    and checks it against the mesh with the model's own rules."""
    job = _job(argv)
    with pytest.raises(ValueError) as early:
        precheck(job)
    with pytest.raises(ValueError) as full:
        check(job)
    assert message in str(early.value)
    assert str(early.value) == str(full.value)


@pytest.mark.parametrize("argv", [["--tp", "2"], ["--arch", "moe", "--tp", "2"],
                                  ["--heads", "2", "--tp", "2", "--kv-heads", "1"],
                                  ["--arch", "mllm", "--tp", "3"]])
def test_early_checks_pass_what_they_cannot_refuse(argv) -> None:
    precheck(_job(argv))  # mllm's heads are its family's to check


def _run(command: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = ("import sys; from stp.cli.main import main; "
            f"rc = main([{command!r}, *sys.argv[1:]]); print('torch' in sys.modules); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC})


@pytest.mark.parametrize("command,argv,message", [
    ("train", *BAD[0]), ("train", *BAD[1]), ("train", *BAD[4]), ("memory", *BAD[0]),
])
def test_refused_without_importing_torch(command, argv, message) -> None:
    out = _run(command, argv)
    assert out.returncode == 2, out.stderr
    assert out.stdout.strip() == "False", "torch was imported before the refusal"
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr
