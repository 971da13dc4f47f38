"""Emulated compute (stp.models.emulated): durations as the simulator cuts them,
units that wait instead of computing, and `stp train --emulate-compute`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stp.cli.main import main
from stp.models.emulated import (
    EmulatedStage,
    UnitTimes,
    emulated_builder,
    hold,
    parse_emulate,
    parse_times,
    unit_times,
)
from stp.runtime.braid import UnitRunner
from stp.schedule.ir import Block, Kind, Pass
from stp.sim.costs import Costs


def test_durations_parse_in_ms_and_refuse_communication():
    assert parse_emulate("f=24,b=24,w=16") == Costs(f=0.024, b=0.024, w=0.016)
    assert parse_times("f=2") == (2.0, 0.0, 0.0)
    for bad, needle in [("ar=1", "not accepted"), ("f=x", "not a number"), ("f=-1", ">= 0"),
                        ("f=0", "at least one"), ("f", "not accepted")]:
        with pytest.raises(ValueError, match=needle):
            parse_times(bad)


def test_units_are_cut_as_the_simulator_cuts_a_pass():
    # one pass through a chunk: cost / v; a unit: cost / v / (2 layers)
    t = unit_times(Costs(f=0.024, b=0.048, w=0.012), chunks=2, layers=3)
    assert t == pytest.approx(UnitTimes(0.002, 0.004, 0.001))
    build = emulated_builder(Costs(f=0.024, b=0.024, w=0.012), 2, 5, 16)
    stages = [build(s, 4) for s in range(4)]
    assert [len(s.units) for s in stages] == [4, 2, 2, 2]  # 5 layers: the first stage gets 2
    for s in stages:
        assert len(s.units) * s.times.f == pytest.approx(0.012)


def test_hold_waits_at_least_its_duration():
    start = time.perf_counter()
    hold(0.005)
    took = time.perf_counter() - start
    assert 0.005 <= took < 0.1


def _run_stage(first: bool, last: bool) -> tuple[list, UnitRunner, EmulatedStage]:
    st = EmulatedStage(0 if first else 1, 1 if first and last else 3, layers=2, hidden=8,
                       times=UnitTimes(1e-3, 1e-3, 1e-3))
    st.stage = 1  # run it as stage 1 of the runner either way
    outs: list = []
    x = torch.zeros(2, 4, dtype=torch.long) if first else torch.zeros(2, 4, 8)
    runner = UnitRunner({1: st}, take=lambda p: x if p.kind is Kind.F else torch.zeros(2, 4, 8),
                        give=lambda p, y: outs.append((str(p), y)), targets=lambda mb: None)
    return outs, runner, st


def test_emulated_units_move_real_sizes_and_take_their_time():
    outs, runner, st = _run_stage(first=True, last=False)
    start = time.perf_counter()
    runner.run(Pass(1, Kind.F, 0))
    assert time.perf_counter() - start >= 4e-3  # four units of 1 ms
    runner.run(Block((Pass(1, Kind.F, 1), Pass(1, Kind.BW, 0))))
    runner.run(Pass(1, Kind.B, 1))
    runner.run(Pass(1, Kind.W, 1))
    runner.release()
    got = dict(outs)
    assert got["1F0"].shape == (2, 4, 8) and got["1F1"].shape == (2, 4, 8)
    assert got["1B0"] is None and got["1I1"] is None  # a first stage: no input gradient
    assert not st.shapes  # per-microbatch state is freed


def test_last_emulated_stage_returns_a_loss_and_checks_inputs():
    outs, runner, st = _run_stage(first=False, last=True)
    st.is_last = True
    runner.run(Pass(1, Kind.F, 0))
    assert outs[0][1].shape == () and float(outs[0][1]) == 0.0
    with pytest.raises(ValueError, match="3-dim input"):
        st.check_input(torch.zeros(2, 4), None)
    assert st.launch_allreduce(torch.ones(3))[1] is None  # one TP rank: nothing in flight


def _stp(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def test_train_refuses_bad_emulation_and_trace_paths(tmp_path: Path, capsys):
    for argv, needle in [
        (["--emulate-compute", "ar=1"], "--emulate-compute item 'ar=1' not accepted"),
        (["--trace", str(tmp_path / "missing" / "t.json")], "does not exist"),
        (["--emulate-compute", "f=1", "--offload", "stp"], "no activations to offload"),
    ]:
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_train_with_emulated_compute_writes_a_trace(tmp_path: Path):
    trace = tmp_path / "run.json"
    out = _stp("train", "--pp", "2", "--schedule", "zb-v", "-m", "4", "--steps", "2",
               "--layers", "4", "--hidden", "16", "--seq-len", "8", "--microbatch-size", "1",
               "--emulate-compute", "f=8,b=8,w=4", "--trace", str(trace), "--json",
               "--out", str(tmp_path / "ckpt"))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == 0.0 for r in rows)
    assert "emulated compute" in out.stderr and str(trace) in out.stderr
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["emulate"] == "f=8,b=8,w=4" and doc["otherData"]["schedule"] == "zb-v"
    compute = [e for e in doc["traceEvents"] if e.get("cat") == "compute"]
    assert {e["pid"] for e in compute} == {0, 1}
    # 4 layers over 4 stages: each pass is 2 units; per rank 4 mb x 2 chunks x (F, B, W)
    assert sum(e["pid"] == 0 for e in compute) == 4 * 2 * 3 * 2
    f_units = [e["dur"] for e in compute if e["args"]["kind"] == "F"]
    assert min(f_units) >= 8e3 / 2 / 2 * 0.99  # f / v / units, in microseconds
