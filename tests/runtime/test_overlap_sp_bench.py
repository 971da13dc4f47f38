"""`stp bench overlap --sequence-parallel` in emulated compute (2 gloo processes, tiny):
the report holds the sequence-parallel figures (reduce-scatters and all-gathers,
stp.bench.emulated_sp) beside the all-reduce's, each hidden fraction in [0, 1], and
the SP block launched all-gathers early (the braid runner's advance). Figures are
not checked: benchmarks, not timed tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_emulated_overlap_reports_sp_beside_the_allreduce():
    out = subprocess.run(
        [sys.executable, "-m", "stp.cli.main", "bench", "overlap", "--sequence-parallel",
         "--mode", "emulated", "--layers", "2", "--hidden", "16", "--seq-len", "8",
         "--repeats", "1", "--unit-ms", "f=1,b=1,w=1", "--json"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert sorted(k for k in res if isinstance(res[k], dict)) == ["emulated", "emulated_sp"]
    for key in ("emulated", "emulated_sp"):
        r = res[key]
        assert 0 <= r["hidden_fraction"] <= 1 and 0 <= r["wait_hidden_fraction"] <= 1, r
        assert r["allreduces"] == 2 * 4  # F and B of 4 units: one collective each
        assert r["exposed_sequential_s"] > 0
    assert res["emulated"]["advanced"] == 0 < res["emulated_sp"]["advanced"]
    assert "emulated AR" in out.stdout and "emulated SP" in out.stdout
    assert "reduce-scatter" in out.stdout
