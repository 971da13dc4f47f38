"""`stp train --tp-overlap [--tp-overlap-chunks K]`: refused in one line (exit 2) where
it cannot run, applied from a plan (keys tp_overlap, tp_overlap_chunks), and stated
in the run's `ran:` line only where it took effect (sequence parallelism at tp > 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stp.cli.flags import from_args
from stp.cli.main import build_parser, main
from stp.cli.train_output import ran_line
from stp.train.run.config import TrainJob
from stp.train.run.job import model_config
from stp.train.run.loop import RunSummary
from stp.train.run.plan_file import with_plan

OUT = ["--steps", "1", "--out", "/nonexistent/never-created"]
SP = ["--tp", "2", "--sequence-parallel", "--tp-overlap"]


@pytest.mark.parametrize("argv, words", [
    (["--tp", "2", "--tp-overlap"], ["--tp-overlap", "add --sequence-parallel"]),
    ([*SP, "--seq-len", "20", "--tp-overlap-chunks", "4"],
     ["--tp-overlap-chunks 4", "--seq-len 20", "--tp 2"]),
    ([*SP, "--tp-overlap-chunks", "0"], ["--tp-overlap-chunks", "0 must be >= 1"]),
    ([*SP, "--compile"], ["--tp-overlap", "--compile"]),
    ([*SP, "--recompute", "full"], ["--tp-overlap", "--recompute full"]),
    ([*SP, "--arch", "mllm"], ["--tp-overlap", "--arch mllm"]),
])
def test_what_cannot_run_is_one_line_exit_2(capsys, argv: list[str], words: list[str]) -> None:
    assert main(["train", *argv, *OUT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert all(w in err for w in words), err


def _ran(*argv: str) -> str:
    job = from_args(TrainJob, build_parser().parse_args(["train", *argv]))
    summary = RunSummary(job=job, microbatches=job.num_microbatches, backend="gloo",
                         device="cpu", parameters=140_000, losses=(1.0,), step_times_s=(0.1,),
                         tokens_per_step=1, resident_activation_bytes=None, checkpoint=None)
    return ran_line(summary, model_config(job))


def test_ran_line_states_the_chunks_where_they_took_effect() -> None:
    assert "| sp on | tp-overlap 2 chunks | recompute" in _ran(*SP, "--tp-overlap-chunks", "2")
    assert "| sp on | tp-overlap 4 chunks |" in _ran(*SP)  # the default K
    assert "tp-overlap" not in _ran("--sequence-parallel", "--tp-overlap")  # tp 1: no effect
    assert "tp-overlap" not in _ran("--tp", "2", "--sequence-parallel")


def _plan(tmp_path: Path, job: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": 1, "plans": [{"job": job, "flags": []}]}))
    return str(path)


def test_a_plan_applies_tp_overlap_and_its_chunks(tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"tp": 2, "sequence_parallel": True, "tp_overlap": True,
                            "tp_overlap_chunks": 2})
    job = with_plan(TrainJob(plan=plan))
    assert (job.tp, job.sequence_parallel, job.tp_overlap, job.tp_overlap_chunks) == (
        2, True, True, 2)


def test_a_plan_with_zero_chunks_is_refused_in_one_line(capsys, tmp_path: Path) -> None:
    plan = _plan(tmp_path, {"tp": 2, "sequence_parallel": True, "tp_overlap": True,
                            "tp_overlap_chunks": 0})
    assert main(["train", "--plan", plan, *OUT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp_overlap_chunks=0" in err, err


@pytest.mark.parametrize("options, words", [
    ({"tp_overlap_chunks": 2}, "needs --sequence-parallel"),
    ({"tp_overlap_chunks": -1, "sequence_parallel": True}, "integer >= 0"),
    ({"tp_overlap_chunks": True, "sequence_parallel": True}, "integer >= 0"),
    ({"tp_overlap_chunks": 2, "sequence_parallel": True, "compile": True}, "--compile"),
])
def test_trainer_options_refuse_what_cannot_run(options: dict, words: str) -> None:
    from stp.train.run.parts import TrainerOptions

    with pytest.raises(ValueError, match=words):
        TrainerOptions(**options)
    TrainerOptions(tp_overlap_chunks=2, sequence_parallel=True)  # the accepted case
