"""`stp train`: JSON output, checkpoint, the same losses on any mesh, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import free_port
from safetensors.torch import load_file

from stp.cli.main import main

TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16",
        "--microbatch-size", "1", "--steps", "3", "--timeout", "60"]


def _stp(*argv: str, env: dict[str, str] | None = None, timeout: float = 120):
    cmd = [sys.executable, "-m", "stp.cli.main", *argv]
    full_env = {**os.environ, **(env or {})}
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return out, time.monotonic() - start


def _json_losses(stdout: str) -> list[float]:
    rows = [json.loads(line) for line in stdout.splitlines()]  # every line is JSON
    assert rows[-1]["summary"] is True and "loss" not in rows[-1]  # the closing object
    assert set(rows[-1]["memory"]) == {"weights", "grads", "masters", "optimizer",
                                       "activations_peak", "total"}
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert set(r) >= {"step", "loss", "tokens_per_s"} and r["tokens_per_s"] > 0
    return [r["loss"] for r in rows]


@pytest.mark.slow
def test_same_losses_on_one_process_and_on_meshes(tmp_path: Path) -> None:
    """Same seed, data and global batch (dp x m x microbatch size = 8): the
    same per-step losses, float64, up to summation order (1e-9 relative)."""
    runs = {
        "single": ["--pp", "1", "-m", "8"],
        "pp2-tp2-stp": ["--pp", "2", "--tp", "2", "--schedule", "stp", "-m", "8"],
        "pp2-dp2-zbv": ["--pp", "2", "--dp", "2", "--schedule", "zb-v", "-m", "4"],
    }
    losses = {}
    for name, mesh in runs.items():
        out, _ = _stp("train", *TINY, "--dtype", "float64", "--json", *mesh,
                      "--out", str(tmp_path / name), "--save-full",
                      str(tmp_path / f"{name}.safetensors"), timeout=180)
        assert out.returncode == 0, out.stderr
        losses[name] = _json_losses(out.stdout)
        assert len(losses[name]) == 3
        assert "checkpoint" in out.stderr  # the summary goes to stderr with --json
    ref = losses["single"]
    assert ref[-1] < ref[0]
    for name, ls in losses.items():
        assert max(abs(a - b) / abs(b) for a, b in zip(ls, ref, strict=True)) <= 1e-9, (name, ls)
    model = load_file(tmp_path / "pp2-tp2-stp.safetensors")  # --save-full, stage by stage
    single = load_file(tmp_path / "single.safetensors")
    assert set(model) == set(single)
    worst = max(float((model[n] - t).abs().max()) for n, t in single.items())
    assert worst < 1e-9
    assert model["embed.weight"].shape == (256, 32)  # TP shards concatenated


def test_single_process_run_prints_progress_and_summary(tmp_path: Path) -> None:
    out, _ = _stp("train", *TINY, "--pp", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "step 3/3" in out.stderr and "tok/s" in out.stderr and "loss" in out.stderr
    assert "trained 3 steps of stp" in out.stdout
    assert f"checkpoint: {tmp_path / 'step-00000003'} (sharded" in out.stdout
    assert not (tmp_path / "checkpoint.pt").exists()  # nothing gathered on rank 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tp", "3"], "--heads 4 must be divisible by --tp 3"),
        (["--tp", "3", "--heads", "6", "--hidden", "48"],
         "the MLP width (from --hidden) 128 must be divisible by --tp 3"),
        (["--schedule", "zb-v", "--pp", "2", "--layers", "3"],
         "--layers 3 is fewer than the schedule's 4 stages"),
        (["-m", "0"], "0 must be >= 1"),
        (["--data", "/nonexistent/c.txt"], "data path '/nonexistent/c.txt' does not exist"),
        (["--schedule", "nope"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, message) -> None:
    start = time.process_time()
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1, err
    # refused before any training: CPU seconds, which a loaded machine does not stretch
    assert time.process_time() - start < 10


def test_world_size_mismatch_under_torchrun_env() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out, _ = _stp("train", "--pp", "2", env=env, timeout=60)  # a hang fails here
    assert out.returncode == 2
    assert "world size 3 does not match pp x tp x dp = 2 x 1 x 1 = 2" in out.stderr
    assert out.stderr.count("\n") == 1


@pytest.mark.slow
def test_torchrun_bad_input_every_rank_exits_promptly() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "stp.cli.main", "train", "--pp", "2", "--tp", "2"]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    # promptly: well before a rank's 120 s wait on its peers (two torch imports on a
    # loaded 2-core machine take tens of seconds)
    assert time.monotonic() - start < 90
    assert out.returncode != 0
    line = "world size 2 does not match pp x tp x dp = 2 x 2 x 1 = 4"
    assert out.stderr.count(line) == 1, out.stderr  # reported once, by rank 0
