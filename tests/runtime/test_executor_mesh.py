"""The executor's inputs without processes: mesh layout, data, lowering sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stp.runtime.errors import first_line, is_timeout
from stp.runtime.mesh import Coord, ParallelDims
from stp.train.data.corpus import ByteBatches, read_corpus, split_batch, stdlib_files


@settings(deadline=None)  # no wall-time bound: a loaded machine is slow
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_rank_layout_round_trips_and_groups_partition_the_world(pp, tp, dp):
    dims = ParallelDims(pp, tp, dp)
    for rank in range(dims.world_size):
        assert dims.rank_of(dims.coord_of(rank)) == rank
    for axis in ("pp", "tp", "dp"):
        groups = dims.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        assert all(len(g) == getattr(dims, axis) for g in groups)
        for g in groups:  # group rank i has coordinate i on the axis
            assert [getattr(dims.coord_of(r), axis) for r in g] == list(range(len(g)))


def test_tp_ranks_are_consecutive():
    dims = ParallelDims(pp=2, tp=2, dp=2)
    assert dims.group_ranks("tp", Coord(1, 0, 1)) == [6, 7]
    assert dims.group_ranks("dp", Coord(1, 1, 0)) == [5, 7]
    assert dims.group_ranks("pp", Coord(0, 1, 1)) == [3, 7]


@pytest.mark.parametrize("kw", [{"pp": 0}, {"tp": -1}, {"dp": 1.5}, {"pp": True}])
def test_bad_sizes_are_refused(kw):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ParallelDims(**kw)


def test_world_size_must_match():
    with pytest.raises(ValueError, match=r"world size 3 does not match pp x tp x dp = 2 x 2 x 1"):
        ParallelDims(2, 2, 1).check_world(3)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        ParallelDims().group_ranks("ep", Coord(0, 0, 0))


def test_default_corpus_is_the_stdlib_sorted_and_capped():
    files = stdlib_files()
    assert len(files) > 50 and [f.name for f in files] == sorted(f.name for f in files)
    data = read_corpus(max_bytes=100_000)
    assert len(data) == 100_000 and data.startswith(files[0].read_bytes()[:1000])


def test_corpus_from_a_directory_and_errors(tmp_path: Path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_bytes(b"B" * 600)
    (tmp_path / "a.txt").write_bytes(b"A" * 600)
    assert read_corpus(tmp_path) == b"A" * 600 + b"B" * 600
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus(tmp_path / "missing")
    (tmp_path / "tiny.txt").write_bytes(b"x")
    with pytest.raises(ValueError, match="at least 1024"):
        read_corpus(tmp_path / "tiny.txt")


def test_batches_are_a_function_of_seed_and_step():
    data = bytes(range(256)) * 20
    a = ByteBatches.from_bytes(data, seq_len=16, batch_size=6, seed=1)
    b = ByteBatches.from_bytes(data, seq_len=16, batch_size=6, seed=1)
    tokens, targets = a.batch(3)
    assert tokens.shape == targets.shape == (6, 16) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert torch.equal(tokens, b.batch(3)[0]) and not torch.equal(tokens, a.batch(4)[0])


def test_split_batch_gives_each_replica_its_rows():
    batch = torch.arange(12).view(12, 1)
    parts = split_batch(batch, dp=2, dp_rank=1, num_microbatches=3)
    assert [p.view(-1).tolist() for p in parts] == [[6, 7], [8, 9], [10, 11]]
    with pytest.raises(ValueError, match="does not split"):
        split_batch(batch, dp=5, dp_rank=0, num_microbatches=1)


def test_backend_errors_are_recognised_and_trimmed():
    err = RuntimeError("[../gloo/tcp/pair.cc:534] Connection closed by peer [1.2.3.4]\nmore")
    assert is_timeout(err)
    assert first_line(err) == "Connection closed by peer [1.2.3.4]"
    assert not is_timeout(RuntimeError("shape mismatch"))
