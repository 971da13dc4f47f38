"""`stp train --arch mllm` trains with the per-step losses of the single-process
multimodal reference (stp.models.mllm.reference, AdamW on the same batches):
float64, 1e-9, braiding on, on pp2 x tp2 (stp), pp3 (1f1b, an uneven partition
with the encoder sharing a stage with a decoder layer) and pp2 x dp2.
`--partition auto` resolves to counts (vision blocks first) that the run uses,
with the losses of a run given those counts explicitly."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stp.cli.main import main
from stp.models.mllm.reference import build_mllm_reference
from stp.train.families.mllm import mllm_batches
from stp.train.run.config import ModelShape, TrainJob, VisionShape
from stp.train.run.job import check, model_config
from stp.train.run.resolve import resolve
from stp.train.run.schedules import job_schedule
from stp.train.step.lr import adamw

# tiny shapes: the runs are start-up bound; the widths still split over tp 2
SHAPE = ["--arch", "mllm", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "12",
         "--vision-layers", "2", "--image-size", "8", "--patch", "2", "--vision-hidden", "8",
         "--microbatch-size", "1",
         "-m", "4", "--steps", "2", "--dtype", "float64", "--timeout", "60", "--braid", "on"]
JOB = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=12),
               vision=VisionShape(image_size=8, patch=2, vision_layers=2, vision_hidden=8),
               microbatches=4,
               microbatch_size=1, steps=2, dtype="float64")


def _reference_losses(job: TrainJob, steps: int) -> list[float]:
    cfg = model_config(job)
    model = build_mllm_reference(cfg, torch.float64)
    opt = adamw(resolve(job).job.lr)(list(model.parameters()))  # the default of its width
    batches, out = mllm_batches(job, cfg), []
    for step in range(steps):
        opt.zero_grad()
        loss = model.loss(*batches.batch(step))
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _stp_run(argv: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *SHAPE, "--json", *argv,
           "--out", str(out)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert got.returncode == 0, got.stderr[-3000:]
    return got


def _stp_losses(argv: list[str], out: Path) -> list[float]:
    rows = map(json.loads, _stp_run(argv, out).stdout.splitlines())
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("argv", [
    ["--pp", "2", "--tp", "2", "--schedule", "stp"],
    ["--pp", "3", "--schedule", "1f1b", "--partition", "1,2,1"],
    ["--pp", "2", "--dp", "2", "--schedule", "1f1b"],
], ids=["pp2-tp2-stp", "pp3-1f1b-uneven", "pp2-dp2"])
def test_stp_train_arch_mllm_matches_one_process(argv, tmp_path):
    dp = int(argv[argv.index("--dp") + 1]) if "--dp" in argv else 1
    ref = _reference_losses(dataclasses.replace(JOB, dp=dp), 2)  # the same global batch
    got = _stp_losses(argv, tmp_path)
    assert len(got) == 2
    assert ref[1] < ref[0]  # it trains
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) <= 1e-9, (got, ref)


@pytest.mark.parametrize("schedule, pp", [("1f1b", 2), ("stp", 2), ("1f1b", 3)])
def test_auto_partition_counts_vision_blocks_then_decoder_layers(schedule, pp):
    job = dataclasses.replace(JOB, partition="auto", schedule=schedule, pp=pp)
    check(job)  # auto is accepted
    sch = job_schedule(job)
    run = resolve(job)
    resolved, counts = run.job, run.partition
    assert counts is not None and len(counts) == sch.num_stages and min(counts) >= 1
    assert sum(counts) == JOB.vision.vision_layers + JOB.model.layers
    assert resolved.partition == ",".join(map(str, counts))


def test_stp_train_partition_auto_runs_the_counts_it_chose(tmp_path):
    argv = ["--pp", "2", "--schedule", "1f1b"]
    auto = _stp_run([*argv, "--partition", "auto"], tmp_path / "auto")
    counts = resolve(dataclasses.replace(JOB, partition="auto", pp=2,
                                         schedule="1f1b")).partition
    chosen = ",".join(map(str, counts))
    assert f"layers per global stage: {chosen}\n" in auto.stderr, auto.stderr
    explicit = _stp_losses([*argv, "--partition", chosen], tmp_path / "explicit")
    got = [r["loss"] for r in map(json.loads, auto.stdout.splitlines()) if "loss" in r]
    assert len(got) == 2 and got == explicit  # the same partition: the same floats


def test_auto_partition_with_fewer_layers_than_stages_is_one_line(tmp_path, capsys):
    # stp on pp3 has 6 global stages for 2 vision + 2 decoder layers
    code = main(["train", *SHAPE, "--pp", "3", "--schedule", "stp", "--partition", "auto",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "--partition auto" in err, err
    assert "2 vision + 2 decoder layers" in err and "6 stages" in err, err


@pytest.mark.parametrize("change, needle", [
    ({"save_hf": "hf"}, "no Hugging Face layout.*--out keep the full state"),
    ({"data": "x.txt"}, "drop --data"),
    ({"vision": VisionShape(vision_hidden=16)}, "must be <= the decoder hidden 32"),
    ({"vision": VisionShape(image_size=30)}, "image_size=30 must be divisible"),
    ({"tp": 4, "vision": dataclasses.replace(JOB.vision, vision_heads=2)},
     "vision heads=2 must be divisible by tp=4"),
])
def test_bad_mllm_settings_are_refused_before_training(change, needle, tmp_path):
    job = dataclasses.replace(JOB, out=str(tmp_path), **change)
    with pytest.raises(ValueError, match=needle):
        check(job)
