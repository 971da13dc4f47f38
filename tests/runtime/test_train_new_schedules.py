"""`stp train --schedule dualpipev|looped-bfs|zb-interleaved`: each trains on
two pipeline ranks and gives the single-process run's losses (float64, same
seed, data and global batch, 1e-9 relative)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_cli import TINY, _json_losses, _stp

NAMES = ("dualpipev", "looped-bfs", "zb-interleaved")


@pytest.mark.slow
def test_train_runs_the_new_schedules(tmp_path: Path) -> None:
    losses = {}
    for name, mesh in [("single", ["--pp", "1"])] + [(n, ["--pp", "2", "--schedule", n])
                                                     for n in NAMES]:
        out, _ = _stp("train", *TINY, "-m", "8", "--dtype", "float64", "--json", *mesh,
                      "--out", str(tmp_path / name), timeout=180)
        assert out.returncode == 0, out.stderr
        losses[name] = _json_losses(out.stdout)
    ref = losses.pop("single")
    assert len(ref) == 3 and ref[-1] < ref[0]
    for name, ls in losses.items():
        assert max(abs(a - b) / abs(b) for a, b in zip(ls, ref, strict=True)) <= 1e-9, (name, ls)
