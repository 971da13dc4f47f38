"""The sharded optimizer (`shard_optimizer=True`, ZeRO stage 1; stp.train.step.zero).

In one process: the rank-major layout packs and unpacks any shapes (rows
fewer than dp ranks: empty chunks), a reduce-scatter emulated by summing the
packed buffers hands each rank the sum of its rows, and a row box lies at its
offset with padding rows left out.

On pp2 x dp2 (float64, clipping active, a cosine schedule): the losses,
gradient norms and lrs of 3 steps, and the parameters after them, equal the
single-process torch reference within 1e-9; after the first step each rank's
gradient shards equal its rows of the unsharded run's DP-averaged gradients,
and each rank holds the AdamW moments of its rows only (half the unsharded
run's, summed over the replicas: all of them). A checkpoint saved sharded
after step 2 resumes sharded on the same mesh bit for bit, and unsharded on
one process within 1e-9; one saved unsharded resumes sharded. An inf gradient on one rank skips the
step on every rank. In bfloat16 the
fp32 masters and the moments are split the same way, and training equals the
unsharded bf16 run exactly (see `test_bf16_equals_unsharded_bf16`).

Slow: pp2 x tp2 x dp2 against the reference; tp2 x dp4 on a vocabulary of 9
(padded to 10 over tp2: a DP shard of padding rows only, and an empty one)
equals the unsharded run, and its sharded checkpoint resumes unsharded; the
pp2 x dp2 checkpoint resumes on dp4.
"""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch
from _dist import run_dist
from _train_common import (
    CLIP,
    CONFIG,
    TOL,
    M,
    batch,
    optimizer,
    options,
    reference,
    train,
    worst,
    worst_param,
)

from stp.cli.flags import add_flags, from_args
from stp.models import ModelConfig
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.checkpoint.shards import Box
from stp.train.run.config import TrainJob
from stp.train.run.memory_check import run_estimate
from stp.train.run.memory_measure import measure
from stp.train.run.resolve import resolve
from stp.train.step.shard_layout import ShardLayout, row_box
from stp.train.step.trainer import Trainer
from stp.train.step.zero import DPGroup, ShardedPrecision

STEPS, SAVE_AT = 3, 2


# -- one process: the layout ---------------------------------------------------------------


SHAPES = [torch.Size(s) for s in [(5, 3), (1,), (2, 2, 2), (8,), (3, 4)]]
"""Rows below, at and above dp=4, not dividing by it: some ranks' chunks are empty."""


def test_pack_then_unpack_restores_every_shape() -> None:
    layout = ShardLayout(SHAPES, 4)
    tensors = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    flat = torch.full((4 * layout.segment,), float("nan"), dtype=torch.float64)
    layout.pack(tensors, flat)
    assert not flat.isnan().any(), "padding rows must be written (zero)"
    back = [torch.empty_like(t) for t in tensors]
    layout.unpack(flat, back)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))


def test_each_rank_segment_holds_the_sum_of_its_rows() -> None:
    """What reduce_scatter_single hands rank k: segment k of the summed packed buffers."""
    dp = 4
    layout = ShardLayout(SHAPES, dp)
    replicas = [[torch.randn(s, dtype=torch.float64) for s in SHAPES] for _ in range(3)]
    total = torch.zeros(dp * layout.segment, dtype=torch.float64)
    for tensors in replicas:
        flat = torch.empty_like(total)
        layout.pack(tensors, flat)
        total += flat
    summed = [sum(ts) for ts in zip(*replicas, strict=True)]
    covered = [0] * len(SHAPES)
    for rank in range(dp):
        segment = total.view(dp, layout.segment)[rank]
        for i, shape in enumerate(SHAPES):
            start, stop = layout.splits[i].rows_of(rank)
            assert torch.equal(layout.local(segment, i, rank, shape), summed[i][start:stop])
            covered[i] += stop - start
    assert covered == [s[0] for s in SHAPES]  # every row on exactly one rank
    assert layout.splits[1].rows_of(1) == (1, 1)  # one row over 4 ranks: empty chunks


def test_row_box_leaves_padding_rows_out() -> None:
    # tp rank 1 of a vocabulary of 9 padded to 10: rows 5..8 real, local row 4 padding
    vocab = Box(torch.Size([9, 4]), torch.Size([5, 0]), dim=0, length=4)
    assert row_box(vocab, 2, 4) == Box(torch.Size([9, 4]), torch.Size([7, 0]), 0, 2)
    assert row_box(vocab, 4, 5).real(torch.zeros(1, 4)).numel() == 0
    # sharded along dim 1 (a row-parallel weight): rows move the offset along dim 0
    cols = Box(torch.Size([6, 8]), torch.Size([0, 4]), dim=1, length=4)
    assert row_box(cols, 3, 6).offsets == torch.Size([3, 4])


def test_parameters_it_cannot_split_are_refused_in_one_line() -> None:
    dp = DPGroup(2, 0, None, run=None)
    gain = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="'scale' is a scalar"):
        ShardedPrecision([("w", gain), ("scale", torch.nn.Parameter(torch.tensor(1.0)))], (), dp)
    mixed = [("w", gain), ("b", torch.nn.Parameter(torch.ones(2, dtype=torch.float64)))]
    with pytest.raises(ValueError, match="one parameter dtype"):
        ShardedPrecision(mixed, (), dp)
    ok = ShardedPrecision([("w", gain)], (), dp)  # pure: the shard is a view of rows 0..1
    assert ok.params[0].data_ptr() == gain.data_ptr() and ok.params[0].shape == (2,)


def test_the_flag_reaches_the_trainer_and_the_memory_check() -> None:
    """`stp train --shard-optimizer` is TrainJob.shard_optimizer, the Trainer's option,
    and the pre-launch estimate divides masters and moments by dp."""
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainJob)
    args = ["--dp", "2", "--dtype", "bfloat16", "--steps", "1"]
    plain = resolve(from_args(TrainJob, parser.parse_args(args)))
    sharded = resolve(from_args(TrainJob, parser.parse_args([*args, "--shard-optimizer"])))
    assert sharded.job.shard_optimizer and not plain.job.shard_optimizer
    assert sharded.trainer_options().shard_optimizer and not plain.trainer_options().shard_optimizer
    before, after = run_estimate(plain).peak, run_estimate(sharded).peak
    assert after.masters == before.masters / 2 and after.optimizer == before.optimizer / 2


# -- pp2 x dp2: parity, gradients, state, checkpoints -------------------------------------


def _trainer(mesh: Mesh, shard: bool, **kw) -> Trainer:
    return Trainer(CONFIG, optimizer(), registry.make("stp", 2, M), mesh=mesh,
                   shard_optimizer=shard, **options(**kw))


def _resume(root: str, mesh: Mesh, shard: bool) -> Trainer:
    return Trainer.resume(root, CONFIG, optimizer(), registry.make("stp", 2, M), mesh=mesh,
                          shard_optimizer=shard, **options())


def _moments(trainer: Trainer) -> int:
    return sum(v.numel() for s in trainer.optimizer.state.values() for k, v in s.items()
               if k in ("exp_avg", "exp_avg_sq"))


def _first_step(trainer: Trainer) -> tuple[list[tuple[float, float, float]], list[torch.Tensor]]:
    """(step 0's (loss, grad_norm, lr), the gradients the optimizer read)."""
    stats = train(trainer, range(1))
    return stats, [g.clone() for g in trainer.parts.precision.grads()]


def _four_ranks(rank: int, world: int, root: str) -> dict:
    mesh = Mesh.from_world(ParallelDims(2, 1, 2), timeout=60)
    plain, sharded = _trainer(mesh, False), _trainer(mesh, True)
    assert isinstance(sharded.parts.precision, ShardedPrecision)
    (_, whole), (stats, shards) = _first_step(plain), _first_step(sharded)
    splits = sharded.parts.precision.layout.splits
    rows = [whole[i][slice(*s.rows_of(mesh.coord.dp))] for i, s in enumerate(splits)]
    out: dict = {
        "grads_equal": all(torch.equal(a, b) for a, b in zip(shards, rows, strict=True)),
        "moments": (_moments(plain), _moments(sharded)),
    }
    train(plain, range(1, SAVE_AT))
    stats += train(sharded, range(1, SAVE_AT))
    plain.save(f"{root}/plain")
    sharded.save(f"{root}/sharded")
    plain_tail = train(plain, range(SAVE_AT, STEPS))
    tail = train(sharded, range(SAVE_AT, STEPS))
    params = sharded.full_state_dict()  # tensors stay here: results travel as floats
    if params is not None:
        ref_stats, ref_params = reference(STEPS)
        out.update(reference=ref_stats, param_error=worst_param(params, ref_params))
    again = _resume(f"{root}/sharded", mesh, True)
    out["again"] = train(again, range(SAVE_AT, STEPS))
    out["skip"] = _skip_step(again, rank)
    out["from_plain"] = train(_resume(f"{root}/plain", mesh, True), range(SAVE_AT, STEPS))
    out.update(tail=tail, plain_tail=plain_tail, stats=stats + tail)
    out.update(_bf16(mesh))
    return out


def _skip_step(trainer: Trainer, rank: int) -> dict:
    """A step with an inf planted in one whole gradient of global rank 3 only (before
    its reduce-scatter, which the overlap launches during the backward), then a
    clean step."""
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    full_grads = trainer.parts.precision.full_grads

    def poisoned(indices=None) -> list[torch.Tensor]:
        grads = full_grads(indices)
        if grads:
            grads[0].view(-1)[0] = float("inf")
        return grads

    if rank == 3:
        trainer.parts.precision.full_grads = poisoned
    trainer.step(batch(STEPS))
    skipped = trainer.last_update
    unchanged = all(torch.equal(before[n], p) for n, p in trainer.named_parameters())
    trainer.parts.precision.full_grads = full_grads
    trainer.step(batch(STEPS + 1))
    return {"skipped": skipped.skipped, "unchanged": unchanged,
            "next_skipped": trainer.last_update.skipped}


def _bf16(mesh: Mesh) -> dict:
    """Two steps of bf16 unsharded and sharded (no clipping); masters and moments."""
    runs, params = {}, {}
    for shard in (False, True):
        t = _trainer(mesh, shard, dtype=torch.bfloat16, clip_grad=None)
        runs[shard] = (train(t, range(2)), measure(t, None))
        params[shard] = t.full_state_dict()
    same = params[False] is None or all(torch.equal(params[False][n], params[True][n])
                                        for n in params[False])
    return {"bf16": runs, "bf16_same_params": same}


def _one_rank(rank: int, world: int, root: str) -> dict:
    data = (batch(step) for step in itertools.count())  # resume skips the batches used
    trainer = Trainer.resume(f"{root}/sharded", CONFIG, optimizer(), "1f1b", pp=1,
                             microbatches=M, data=data, **options())
    return {"start": trainer.steps_done,
            "one": [(trainer.step(), trainer.last_update.grad_norm, trainer.last_update.lr)
                    for _ in range(SAVE_AT, STEPS)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("zero"))
    four = run_dist(_four_ranks, 4, root, timeout=600)
    one = run_dist(_one_rank, 1, root, timeout=300)[0]
    return {"four": four, "one": one, "root": root}


def test_pp2_dp2_equals_the_one_process_reference(runs: dict) -> None:
    r = runs["four"][0]
    assert all(norm > CLIP for _, norm, _ in r["stats"]), "clipping must be active"
    assert worst(r["stats"], r["reference"]) <= TOL, (r["stats"], r["reference"])
    assert r["param_error"] <= TOL
    assert all(other["stats"] == r["stats"] for other in runs["four"])  # every rank alike


def test_gradient_shards_are_the_rows_of_the_dp_mean(runs: dict) -> None:
    assert all(r["grads_equal"] for r in runs["four"])


def test_each_replica_holds_the_moments_of_its_rows_only(runs: dict) -> None:
    for pp in (0, 1):  # global ranks pp*2 + dp: a pipeline rank's two replicas
        pair = [runs["four"][pp * 2 + dp]["moments"] for dp in (0, 1)]
        plain = pair[0][0]
        assert pair[1][0] == plain
        assert pair[0][1] + pair[1][1] == plain, pair  # every element once
        assert max(pair[0][1], pair[1][1]) < 0.6 * plain, pair


def test_resume_sharded_on_the_same_mesh_is_bit_for_bit(runs: dict) -> None:
    for r in runs["four"]:
        assert r["again"] == r["tail"]


def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(runs: dict) -> None:
    for rank, r in enumerate(runs["four"]):
        s = r["skip"]
        assert s["skipped"] and s["unchanged"] and not s["next_skipped"], (rank, s)


def test_resume_without_sharding_on_one_process(runs: dict) -> None:
    one, tail = runs["one"], runs["four"][0]["tail"]
    assert one["start"] == SAVE_AT
    assert worst(one["one"], tail) <= TOL, (one["one"], tail)


def test_an_unsharded_checkpoint_resumes_sharded(runs: dict) -> None:
    r = runs["four"][0]
    assert worst(r["from_plain"], r["plain_tail"]) <= 1e-12


def test_bf16_equals_unsharded_bf16(runs: dict) -> None:
    """At dp2 the reduce-scatter adds the same two fp32 numbers as the all-reduce,
    AdamW steps each element alike and rounding a master to bf16 is elementwise:
    the same losses and parameters, bit for bit. The gradient norm is summed in
    another order (per shard), so it agrees to rounding; without clipping it only
    is reported."""
    for r in runs["four"]:
        (plain, p_mem), (sharded, s_mem) = r["bf16"][False], r["bf16"][True]
        assert [x[0] for x in plain] == [x[0] for x in sharded]
        assert worst([x[1:2] for x in plain], [x[1:2] for x in sharded]) <= 1e-12
        assert r["bf16_same_params"]
        for key in ("masters", "optimizer"):  # fp32 masters, AdamW moments (+ step)
            assert s_mem[key] < 0.6 * p_mem[key], (key, p_mem, s_mem)
        assert s_mem["weights"] == p_mem["weights"] and s_mem["grads"] == p_mem["grads"]


# -- slow: tp, padding rows and empty shards, dp4 -----------------------------------------


ODD = ModelConfig(vocab_size=9, hidden=16, num_layers=2, num_heads=2, num_kv_heads=2,
                  ffn_hidden=32, max_seq_len=16, seed=5)
"""A vocabulary of 9: padded to 10 over tp2, 5 local rows cut in chunks of 2 over dp4."""


def _odd_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3000 + step)
    tok = torch.randint(0, ODD.vocab_size, (16, 9), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def _eight_ranks(rank: int, world: int, root: str) -> dict:
    mesh = Mesh.from_world(ParallelDims(2, 2, 2), timeout=120)
    out = {"stats": train(_trainer(mesh, True), range(STEPS))}
    odd_mesh = Mesh.from_world(ParallelDims(1, 2, 4), timeout=120)
    odd: dict = {}
    params = {}
    for shard in (False, True):
        t = Trainer(ODD, optimizer(), "1f1b", mesh=odd_mesh, microbatches=2,
                    shard_optimizer=shard, **options())
        odd[shard] = [(t.step(_odd_batch(s)), t.last_update.grad_norm) for s in range(STEPS)]
        params[shard] = t.full_state_dict()
        if shard:
            t.save(f"{root}/odd")  # DCP checks the saved row boxes cover every tensor
            odd["next"] = [(t.step(_odd_batch(STEPS)), t.last_update.grad_norm)]
    if params[True] is not None:
        odd["param_error"] = worst_param(params[True], params[False])
    plain = Trainer.resume(f"{root}/odd", ODD, optimizer(), "1f1b", mesh=odd_mesh,
                           microbatches=2, **options())  # rows of padding and empty shards
    odd["resumed"] = [(plain.step(_odd_batch(STEPS)), plain.last_update.grad_norm)]
    out["odd"] = odd
    return out


def _dp4(rank: int, world: int, root: str) -> dict:
    mesh = Mesh.from_world(ParallelDims(1, 1, 4), timeout=120)
    t = Trainer.resume(f"{root}/sharded", CONFIG, optimizer(), "1f1b", mesh=mesh,
                       microbatches=2, shard_optimizer=True, **options())
    return {"start": t.steps_done, "tail": train(t, range(SAVE_AT, STEPS))}


@pytest.mark.slow
def test_pp2_tp2_dp2_and_padding_rows(runs: dict) -> None:
    eight = run_dist(_eight_ranks, 8, runs["root"], timeout=900)
    assert worst(eight[0]["stats"], runs["four"][0]["reference"]) <= TOL
    odd = eight[0]["odd"]
    assert worst(odd[True], odd[False]) <= 1e-12
    assert odd["param_error"] <= 1e-12
    assert worst(odd["resumed"], odd["next"]) <= 1e-12  # loaded unsharded, padding rows too


@pytest.mark.slow
def test_resume_sharded_on_dp4(runs: dict) -> None:
    r = run_dist(_dp4, 4, runs["root"], timeout=600)[0]
    assert r["start"] == SAVE_AT
    assert worst(r["tail"], runs["four"][0]["tail"]) <= TOL
