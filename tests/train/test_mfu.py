"""MFU in `stp train`'s log and --json (issue 35): the model's FLOPs of a step as `stp
plan` counts them (matmuls; causal attention counted full; no recomputation) over the
step time, the mesh's devices and their dense peak; null on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stp.costmodel.peaks import Peak, run_peak
from stp.train.run.config import ModelShape, TrainJob
from stp.train.run.mfu import mfu, step_flops
from stp.train.run.resolve import resolve

# layers 2, hidden 64, 4 heads (4 KV heads, head 16), SwiGLU width 192 (8 x 64 / 3 rounded
# up to 64), vocabulary 256, sequence 32, 2 microbatches of 2 sequences
SHAPE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "-m", "2",
         "--microbatch-size", "2"]


def _hand_count() -> int:
    """Counted by hand: a forward's matmuls are 2 FLOPs a multiply-add; the backward
    runs two matmuls of each (input and weight gradients), attention's two without
    weights: F + B + W = 3 x forward."""
    s, h, f, v = 32, 64, 192, 256
    qkv, out, mlp = s * h * (3 * h), s * h * h, s * h * (3 * f)  # multiply-adds
    scores, weighted = s * s * h, s * s * h  # Q K^T and P V, over the whole s x s square
    layer = 2 * (qkv + out + mlp + scores + weighted)
    head = 2 * s * h * v
    per_sequence = 3 * (2 * layer + head)
    return 4 * per_sequence  # 2 microbatches x 2 sequences


def test_step_flops_is_the_hand_count():
    assert _hand_count() == 100_663_296
    job = TrainJob(pp=1, schedule="1f1b", microbatches=2, microbatch_size=2,
                   model=ModelShape(layers=2, hidden=64, heads=4, seq_len=32))
    assert step_flops(resolve(job)) == _hand_count()
    # data parallelism multiplies the step's work; tensor and pipeline ranks share it
    wide = TrainJob(pp=2, tp=2, dp=3, schedule="1f1b", microbatches=2, microbatch_size=2,
                    model=ModelShape(layers=2, hidden=64, heads=4, seq_len=32))
    assert step_flops(resolve(wide)) == 3 * _hand_count()


def test_mfu_divides_by_time_devices_and_peak():
    peak = Peak(1e12, "stated")
    assert mfu(100e9, 0.5, 4, peak) == pytest.approx(100e9 / (0.5 * 4 * 1e12))
    assert mfu(100e9, 0.5, 4, None) is None  # the CPU: no peak, no MFU
    assert mfu(None, 0.5, 4, peak) is None  # emulated compute: no model FLOPs


def test_peak_table_by_device_name_and_dtype():
    assert run_peak("NVIDIA H100 80GB HBM3", "bfloat16").flops == 989e12
    assert run_peak("NVIDIA H200", "bfloat16").flops == 989e12
    assert run_peak("NVIDIA H100 PCIe", "bfloat16").flops == 756e12  # not the SXM row
    assert run_peak("NVIDIA A100-SXM4-80GB", "bfloat16").flops == 312e12
    assert run_peak("NVIDIA A100-SXM4-80GB", "float32").flops == 19.5e12
    assert run_peak(None, "float32") is None  # the CPU
    assert run_peak("NVIDIA GeForce GT 710", "bfloat16") is None
    assert run_peak(None, "float32", "h200").flops == 67e12  # --hardware names the card
    assert run_peak(None, "float32", "5e11").flops == 5e11  # or states the peak
    with pytest.raises(ValueError, match="--hardware 'fast'"):
        run_peak(None, "float32", "fast")


def _train(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *SHAPE, "--steps", "2",
           "--schedule", "1f1b", "--out", str(tmp_path / "run"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_json_records_mfu_against_a_stated_peak(tmp_path):
    got = _train(tmp_path, "--pp", "2", "--json", "--hardware", "1e12")
    assert got.returncode == 0, got.stderr[-3000:]
    rows = [json.loads(line) for line in got.stdout.splitlines()]
    steps = [r for r in rows if "loss" in r]
    for r in steps:  # 2 pipeline ranks, each of the stated 1e12 FLOP/s
        assert r["mfu"] == pytest.approx(_hand_count() / (r["step_s"] * 2 * 1e12), rel=1e-9)
    summary = rows[-1]
    assert summary["mfu"] == pytest.approx(_hand_count() / (steps[1]["step_s"] * 2e12),
                                           rel=1e-9)  # the first step is warm-up
    assert "over 2 x 1 TFLOP/s dense (--hardware 1e12)" in got.stderr


def test_cpu_run_records_null_and_says_the_peak_is_unknown(tmp_path):
    got = _train(tmp_path, "--pp", "1", "--json")
    assert got.returncode == 0, got.stderr[-3000:]
    rows = [json.loads(line) for line in got.stdout.splitlines()]
    assert [r["mfu"] for r in rows] == [None, None, None]  # two steps and the summary
    assert "MFU: unknown, no dense float32 peak known for cpu" in got.stderr
