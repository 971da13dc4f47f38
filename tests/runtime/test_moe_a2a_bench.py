"""`stp bench overlap --all-to-all` in emulated compute (2 gloo processes, tiny): the
report holds the expert all-to-all's figures (stp.bench.emulated_a2a: an all-to-all
ends each unit in place of the all-reduce) beside the all-reduce's, from the same
run, each hidden fraction in [0, 1]. Figures are not checked: benchmarks, not
timed tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_emulated_overlap_reports_the_all_to_all_beside_the_allreduce():
    out = subprocess.run(
        [sys.executable, "-m", "stp.cli.main", "bench", "overlap", "--all-to-all",
         "--mode", "emulated", "--layers", "2", "--hidden", "16", "--seq-len", "8",
         "--repeats", "1", "--unit-ms", "f=1,b=1,w=1", "--json"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    keys = ["emulated", "emulated_a2a", "emulated_ar_thread"]
    assert sorted(k for k in res if isinstance(res[k], dict)) == keys
    for key in keys:
        r = res[key]
        assert 0 <= r["hidden_fraction"] <= 1 and 0 <= r["wait_hidden_fraction"] <= 1, r
        assert r["allreduces"] == 2 * 4  # F and B of 4 units: one collective each
        assert r["exposed_sequential_s"] > 0
    assert all(f"emulated {row} " in out.stdout for row in ("AR", "A2A", "AR thr"))
