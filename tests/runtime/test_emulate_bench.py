"""`stp bench overlap` / `stp bench fidelity` run end to end on tiny settings and
print what they promise. Figures are not checked (benchmarks, not timed tests);
only their shape and the bookkeeping that must hold whatever the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stp.cli.main import main


def _stp(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                          text=True, timeout=240, env=dict(os.environ))


@pytest.mark.slow
def test_overlap_bench_reports_both_modes():
    out = _stp("bench", "overlap", "--layers", "2", "--hidden", "16", "--seq-len", "8",
               "--repeats", "1", "--unit-ms", "f=1,b=1,w=1", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["hidden_fraction"] == res["emulated"]["hidden_fraction"]
    for mode, units in (("emulated", 4), ("real", 6)):  # real: + embedding, loss units
        r = res[mode]
        # F then B: one all-reduce per unit, but none for the embedding's backward
        assert r["allreduces"] == 2 * units - (mode == "real")
        assert r["exposed_sequential_s"] > 0 and r["wall_braided_s"] > 0
        assert r["hidden_fraction"] <= 1 and r["launch_braided_s"] <= r["exposed_braided_s"]
    assert "hidden" in out.stdout and "emulated" in out.stdout


@pytest.mark.slow
def test_overlap_bench_sequence_parallel_counts_reduce_scatters():
    out = _stp("bench", "overlap", "--sequence-parallel", "--layers", "2", "--hidden", "16",
               "--seq-len", "8", "--repeats", "1", "--mode", "real", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    r = res["real_sp"]
    assert "emulated" not in res and res["hidden_fraction"] == res["real"]["hidden_fraction"]
    # F then BW over 6 units: a reduce-scatter per unit, none for the embedding's backward
    assert r["allreduces"] == 2 * 6 - 1 and r["advanced"] > 0
    assert 0 <= r["hidden_fraction"] <= 1 and r["launch_braided_s"] <= r["exposed_braided_s"]
    assert "reduce-scatter" in out.stdout and "real SP" in out.stdout


@pytest.mark.slow
def test_fidelity_bench_rows_pair_simulated_and_measured(tmp_path):
    out = _stp("bench", "fidelity", "--schedules", "zb-v,stp", "-m", "4", "--layers", "1",
               "--hidden", "16", "--seq-len", "8", "--steps", "1", "--unit-ms",
               "f=1,b=1,w=1", "--trace-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert [r["schedule"] for r in res["rows"]] == ["zb-v", "stp"]
    for r in res["rows"]:
        assert r["simulated"] > 0 and r["measured"] > 0
        assert r["error"] == pytest.approx(r["measured"] / r["simulated"] - 1)
        # 4 mb x 2 chunks x (F + B + W) units of 1 ms bound the step from below
        assert r["simulated"] >= 4 * 2 * 3 * 2e-3
    for name in ("zb-v", "stp"):
        for kind in ("measured", "simulated"):
            doc = json.loads((tmp_path / f"{name}.{kind}.json").read_text())
            assert doc["otherData"]["schedule"] == name


def test_bench_refuses_bad_settings(capsys):
    assert main(["bench", "fidelity", "--schedules", "nope"]) == 2
    assert "unknown schedule 'nope'" in capsys.readouterr().err
    assert main(["bench", "overlap", "--unit-ms", "x=1"]) == 2
    assert "--unit-ms item 'x=1' not accepted" in capsys.readouterr().err
    assert main(["bench", "overlap", "--heads", "3"]) == 2
    assert "heads must be even" in capsys.readouterr().err
