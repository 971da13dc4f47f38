"""A rank loading its shard of a checkpoint holds about its shard, not the model
(benchmarks/bench_hf_load.py: 233 MB across pp2 x tp2, each rank +62..67 MB for a
58 MB shard, the whole model +250 MB). Here a 60 MB checkpoint: the rank with
the most bytes (stage 0, TP rank 0 of pp2 x tp2: a quarter of the model) peaks
below half the model and below twice its shard. Linux only (/proc/self/status)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_hf_load.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hf_load", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_rank_loads_its_shard_not_the_model(tmp_path: Path) -> None:
    bench = _bench()
    model = bench.write_checkpoint(tmp_path, hidden=512, layers=4, vocab=4096)
    got = bench.measure_in_child(str(tmp_path), 0, 2, 2, 0)
    assert 0.2 * model < got["shard_bytes"] < 0.3 * model
    assert got["peak_increase_bytes"] < 0.5 * model, (got, model)
    assert got["peak_increase_bytes"] < 2 * got["shard_bytes"], (got, model)
