"""benchmarks/bench_vs_torch.py writes the recorded table only for a full run: a
measurement with --no-csv or --no-write must leave benchmarks/results alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_torch.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_torch", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, expect", [
    ([], "default"),
    (["--no-csv"], None),
    (["--no-write"], None),
    (["--out", "x.md"], "x.md"),
    (["--no-csv", "--out", "x.md"], "x.md"),
    (["--no-write", "--out", "x.md"], None),
])
def test_out_file_leaves_the_recorded_table_alone_unless_asked(bench, argv, expect):
    got = bench.out_file(bench._args(argv))
    assert got == (bench.DEFAULT_OUT if expect == "default" else expect)
    assert bench.DEFAULT_OUT.endswith("benchmarks/results/vs_torch.md")
