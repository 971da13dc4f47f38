"""The step's collectives (stp.train.step.grad_sync) on two DP replicas: the DP average
and the loss sum, and a replica that goes away reported as lost, not as a timeout."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from _dist import DistFailure, run_dist
from torch import nn

from stp.cli.flags import add_flags, from_args
from stp.runtime.mesh import Mesh, ParallelDims
from stp.train.run.config import TrainJob
from stp.train.run.parts import TrainerOptions
from stp.train.step.grad_sync import GradSync
from stp.train.step.precision import Precision


class _OneWeight:
    """The least a GradSync reads of a stage: named parameters, none sharded."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight

    def named_parameters(self):
        yield "w", self.weight

    def shard_dim(self, name: str) -> None:
        return None


def _replica(rank: int, world: int, leave: bool,
             overlap: bool = False) -> tuple[list[float], float, float]:
    mesh = Mesh.from_world(ParallelDims(1, 1, 2), timeout=30)
    weight = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    weight.grad = torch.full((3,), float(rank + 1), dtype=torch.float64)  # 1 and 2
    precision = Precision([("w", weight)])
    sync = GradSync(mesh, precision, {0: _OneWeight(weight)}, shared=None, holds_loss=True,
                    device=torch.device("cpu"), overlap=overlap)
    if leave and rank == 1:
        os._exit(0)  # gone without a word, after the replicas agreed on the norm's owners
    if overlap:
        sync.stage_final(0)  # launched in flight, as the executor tells it during a step
    losses = {0: torch.tensor(2.0 + rank, dtype=torch.float64)}  # one microbatch each
    loss, norm = sync.after_backward(losses, 1, 1.0)
    return weight.grad.tolist(), loss, norm


def test_dp_average_loss_and_norm_agree_on_both_replicas() -> None:
    got = run_dist(_replica, 2, False, timeout=60)
    for grads, loss, norm in got:
        assert grads == [1.5, 1.5, 1.5]  # (1 + 2) / 2
        assert loss == 2.5  # (2 + 3) / 2: the mean over replicas
        assert norm == pytest.approx(1.5 * 3 ** 0.5, rel=1e-15)  # counted once, not twice


def test_a_dp_replica_that_leaves_is_reported_lost_not_timed_out() -> None:
    with pytest.raises(DistFailure) as info:
        run_dist(_replica, 2, True, timeout=60, pg_timeout=30)
    err = info.value.errors[0]
    assert err.startswith("PeerLost: rank 0 (pp 0, tp 0, dp 0) in "), err
    assert "closed the connection" in err and "timed out" not in err, err


def test_an_overlapped_reduction_averages_and_its_lost_peer_is_named() -> None:
    """Launched by `stage_final` (async) and finished in `after_backward`: the same
    average; a peer gone while it is in flight is the same one-line rank error,
    naming the DP all-reduce and the group it waited on."""
    for grads, loss, _ in run_dist(_replica, 2, False, True, timeout=60):
        assert grads == [1.5, 1.5, 1.5] and loss == 2.5
    with pytest.raises(DistFailure) as info:
        run_dist(_replica, 2, True, True, timeout=60, pg_timeout=30)
    err = info.value.errors[0].splitlines()[0]
    assert err.startswith("PeerLost: rank 0 (pp 0, tp 0, dp 0) in DP gradient all-reduce: "
                          "a rank in "), err
    assert "closed the connection" in err, err


def test_the_overlap_is_on_by_default_and_the_flag_turns_it_off() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainJob)
    on = from_args(TrainJob, parser.parse_args([]))
    off = from_args(TrainJob, parser.parse_args(["--overlap-grad-sync", "off"]))
    assert on.overlap_grad_sync and not off.overlap_grad_sync
    assert TrainerOptions().overlap_grad_sync
    # and the pre-launch memory estimate prices the flat copies where the flag puts them
    from stp.train.run.memory_check import run_features

    assert run_features(on).overlap_grad_sync and not run_features(off).overlap_grad_sync


class _Weights:
    """A stage of several unsharded parameters."""

    def __init__(self, **weights: nn.Parameter) -> None:
        self.weights = weights

    def named_parameters(self):
        yield from self.weights.items()

    def shard_dim(self, name: str) -> None:
        return None


def _in_place(rank: int, world: int, dtype: torch.dtype, overlap: bool,
              shard: bool = False) -> dict:
    """Two stages on dp2: stage 1's reduction launched first (its last W came first,
    as on a V schedule's first rank), then stage 0's."""
    from stp.train.run.setup import _precision

    mesh = Mesh.from_world(ParallelDims(1, 1, 2), timeout=30)
    shapes = {"a": (4, 3), "b": (5,), "c": (2, 2)}
    weights = {n: nn.Parameter(torch.zeros(s, dtype=dtype)) for n, s in shapes.items()}
    stages = {0: _Weights(a=weights["a"], b=weights["b"]), 1: _Weights(c=weights["c"])}
    precision = _precision(list(weights.items()), [], mesh, shard, [])
    sync = GradSync(mesh, precision, stages, shared=None, holds_loss=True,
                    device=torch.device("cpu"), overlap=overlap)
    for k, w in enumerate(weights.values()):  # rank 0: k + 1, rank 1: 2 (k + 1)
        w.grad = torch.full_like(w, float((k + 1) * (rank + 1)))
    held = []
    if overlap:
        for stage in (1, 0):
            sync.stage_final(stage)
            held.append(sync.held_bytes())
    precision.fold()  # what the trainer does after the executor's backward
    sync.after_backward({0: torch.tensor(1.0, dtype=torch.float64)}, 1, 1.0)
    grads = precision.grads()
    if shard:  # this rank's rows of each gradient, and the packed main grads' sizes
        return {"held": held, "grads": [sorted(set(g.reshape(-1).tolist())) for g in grads],
                "rows": [tuple(g.shape) for g in grads],
                "packed": [pk.flat.numel() for pk in getattr(precision, "packed", [])]}
    return {"held": held, "grads": [sorted(set(g.reshape(-1).tolist())) for g in grads],
            "views": [[g.data_ptr() - flat.data_ptr() for g in (grads[i] for i in idx)]
                      for idx, flat in sync.flat_grads]}


@pytest.mark.parametrize("overlap", [True, False])
def test_bf16_main_grads_are_reduced_in_place_stage_by_stage(overlap: bool) -> None:
    """bf16 with the all-reduce: each stage's fp32 main grads are views of one flat
    buffer, reduced in place (no copy held in flight), the DP mean all the same;
    float32 reduces a flat copy, held while in flight."""
    for got in run_dist(_in_place, 2, torch.bfloat16, overlap, timeout=60):
        assert got["views"] == [[0, 48], [0]]  # a (12 floats) then b; c alone
        assert got["held"] == ([0, 0] if overlap else [])
        assert got["grads"] == [[1.5], [3.0], [4.5]]  # every element the DP mean
    for got in run_dist(_in_place, 2, torch.float32, overlap, timeout=60):
        assert got["views"] == []
        if overlap:  # stage 1's copy, then stage 0's (stage 1's too if not yet complete)
            assert got["held"][0] == 4 * 4 and got["held"][1] in (4 * 17, 4 * 21)
        assert got["grads"] == [[1.5], [3.0], [4.5]]  # every element the DP mean


@pytest.mark.parametrize("overlap", [True, False])
def test_bf16_sharded_main_grads_are_packed_and_reduce_scattered_in_place(
        overlap: bool) -> None:
    """bf16 with the sharded optimizer: each stage's main grads are kept packed
    rank-major (a: 2 rows of 3 a rank, b: 3 elements a rank, one of them padding;
    c: 1 row of 2), each W's gradient added to its chunks there, and its
    reduce-scatter reads them in place: held in flight, only the stage's segment
    of the result (9 floats for stage 0, 2 for stage 1); the shards hold the DP
    mean. float32 packs a copy first."""
    for rank, got in enumerate(run_dist(_in_place, 2, torch.bfloat16, overlap, True,
                                        timeout=60)):
        assert got["packed"] == [2 * (6 + 3), 2 * 2]
        assert got["rows"] == [(2, 3), (3,) if rank == 0 else (2,), (1, 2)]
        assert got["grads"] == [[1.5], [3.0], [4.5]]
        if overlap:  # stage 1's segment, then stage 0's (stage 1's too if not complete)
            assert got["held"][0] == 4 * 2 and got["held"][1] in (4 * 9, 4 * 11)
    for got in run_dist(_in_place, 2, torch.float32, overlap, True, timeout=60):
        assert got["packed"] == [] and got["grads"] == [[1.5], [3.0], [4.5]]
        if overlap:  # the packed copy (dp x segment) and the segment
            assert got["held"][0] == 4 * (2 * 2 + 2)
            assert got["held"][1] in (4 * (2 * 9 + 9), 4 * (2 * 9 + 9 + 6))
