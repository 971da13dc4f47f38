"""Global gradient clipping and LR schedules agree with one process, on any mesh.

float64, clipping active on every step (the norm is above CLIP), a cosine
schedule with warm-up and AdamW with weight decay: each step's loss,
grad_norm (before clipping) and lr, and the parameters after the last step,
equal the single-process torch reference (torch.nn.utils.clip_grad_norm_,
torch.optim.AdamW, LinearLR then CosineAnnealingLR) within 1e-9, on one process, and with every
schedule on pp2 x tp2 and pp2 x dp2 (one 4-process launch, both meshes built
over the same world; behind -m slow, while the default suite runs dp2 with
1F1B). Each of those Trainers first evaluates a held-out batch
(forward passes only): the reference's loss, and training afterwards is
unchanged. A step whose gradients hold inf on one rank is skipped on every
rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
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

import stp.train.step.lr
import stp.train.step.precision
from stp.models import build_reference
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer

STEPS = 3
MESHES = [(2, 2, 1), (2, 1, 2)]


def _compare(stats, params, ref) -> dict:
    ref_stats, ref_params = ref
    return {"stats": worst(stats, ref_stats[: len(stats)]),
            "param": worst_param(params, ref_params),
            "clipped": all(norm > CLIP for _, norm, _ in stats)}


def _one_process(rank: int, world: int) -> dict:
    trainer = Trainer(CONFIG, optimizer(), "1f1b", pp=1, microbatches=M, **options())
    stats = train(trainer, range(STEPS))
    return _compare(stats, trainer.full_state_dict(), reference(STEPS))


def _no_clipping(grads, factor) -> None:
    pass


def _lr_one_step_ahead(self, step, base):
    return _plain_lr(self, step + 1, base)


def _decay_everything(params, weight_decay):
    return [{"params": list(params), "weight_decay": weight_decay}]


_plain_lr = stp.train.step.lr.LRSchedule.lr
BUGS = {
    "no clipping": (stp.train.step.precision, "scale_grads", _no_clipping),
    "lr one step ahead": (stp.train.step.lr.LRSchedule, "lr", _lr_one_step_ahead),
    "weight decay on norms": (stp.train.step.lr, "param_groups", _decay_everything),
}
"""Bugs planted in stp's own clipping, LR schedule and AdamW groups: each must
make the one-process run differ from the torch reference."""


def _one_process_broken(rank: int, world: int) -> dict:
    ref = reference(STEPS)
    out = {}
    for bug, (owner, attr, planted) in BUGS.items():
        kept = getattr(owner, attr)
        setattr(owner, attr, planted)
        try:
            trainer = Trainer(CONFIG, optimizer(), "1f1b", pp=1, microbatches=M, **options())
            out[bug] = _compare(train(trainer, range(STEPS)), trainer.full_state_dict(), ref)
        finally:
            setattr(owner, attr, kept)
    return out


def _skip_step(mesh: Mesh, rank: int) -> dict:
    """Step 1 with an inf planted in one gradient of global rank 3 only."""
    trainer = Trainer(CONFIG, optimizer(), "1f1b", mesh=mesh, microbatches=M, **options())
    train(trainer, range(1))
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    lr = trainer.optimizer.param_groups[0]["lr"]
    fold = trainer.parts.precision.fold

    def poisoned() -> None:
        fold()
        trainer.parts.precision.grads()[0].view(-1)[0] = float("inf")

    if rank == 3:
        trainer.parts.precision.fold = poisoned
    trainer.step(batch(1))
    skipped = trainer.last_update
    unchanged = all(torch.equal(before[n], p) for n, p in trainer.named_parameters())
    lr_kept = trainer.optimizer.param_groups[0]["lr"] == lr
    trainer.parts.precision.fold = fold
    trainer.step(batch(2))
    return {"skipped": skipped.skipped, "norm": skipped.grad_norm, "unchanged": unchanged,
            "lr_kept": lr_kept, "next_skipped": trainer.last_update.skipped}


def _mesh_worker(rank: int, world: int) -> dict:
    ref = reference(STEPS) if rank == 0 else None
    held_out = batch(99)
    ref_eval = build_reference(CONFIG, torch.float64).loss(*held_out).item()
    out: dict = {}
    for dims in MESHES:
        mesh = Mesh.from_world(ParallelDims(*dims), timeout=60)
        for name in registry.names():
            trainer = Trainer(CONFIG, optimizer(), registry.make(name, 2, M), mesh=mesh,
                              **options())
            evaluated = abs(trainer.evaluate(held_out) - ref_eval) / ref_eval
            stats = train(trainer, range(STEPS))
            params = trainer.full_state_dict()
            every: list = [None] * world
            dist.all_gather_object(every, stats)
            if rank == 0:
                out[(dims, name)] = {**_compare(stats, params, ref), "eval": evaluated,
                                     "same_on_every_rank": all(e == stats for e in every)}
    out["skip"] = _skip_step(mesh, rank)  # the last mesh: pp2 x dp2
    return out


@pytest.fixture(scope="module")
def mesh_results() -> list[dict]:
    return run_dist(_mesh_worker, 4, timeout=300)


def test_one_process_equals_torch_clip_grad_norm() -> None:
    r = run_dist(_one_process, 1, timeout=120)[0]
    assert r["clipped"], "clipping must be active on every step"
    assert r["stats"] <= TOL and r["param"] <= TOL, r


def test_planted_bugs_are_reported() -> None:
    """Broken variant: the same comparison and tolerance fail on each bug."""
    res = run_dist(_one_process_broken, 1, timeout=120)[0]
    assert set(res) == set(BUGS)
    for bug, r in res.items():
        print(f"{bug}: stats {r['stats']:.1e} params {r['param']:.1e}")
        assert r["stats"] > TOL or r["param"] > TOL, (bug, r)


def _dp2_worker(rank: int, world: int) -> dict:
    mesh = Mesh.from_world(ParallelDims(1, 1, 2), timeout=60)
    trainer = Trainer(CONFIG, optimizer(), "1f1b", mesh=mesh, microbatches=2, **options())
    stats = train(trainer, range(STEPS))
    every: list = [None] * world
    dist.all_gather_object(every, stats)
    params = trainer.full_state_dict()
    if rank:
        return {}
    return {**_compare(stats, params, reference(STEPS)),
            "same_on_every_rank": all(e == stats for e in every)}


def test_dp2_equals_torch_clip_grad_norm() -> None:
    """The default suite's multi-rank case of the matrix below (tests/train/
    test_clip_limits.py has pp2 and tp2). Bugs guarded: each DP replica counting its
    copy of a gradient in the norm (sqrt(2) too large), the DP average skipped."""
    r = run_dist(_dp2_worker, 2, timeout=300)[0]
    assert r["clipped"] and r["same_on_every_rank"], r
    assert r["stats"] <= TOL and r["param"] <= TOL, r


@pytest.mark.slow
def test_every_schedule_on_pp2_tp2_and_pp2_dp2(mesh_results: list[dict]) -> None:
    res = mesh_results[0]
    expected = {(d, n) for d in MESHES for n in registry.names()}
    assert expected <= set(res)
    bad = []
    for key in sorted(expected):
        r = res[key]
        print(f"{key} loss/grad_norm/lr {r['stats']:.1e} params {r['param']:.1e} "
              f"eval {r['eval']:.1e}")
        if not (r["clipped"] and r["same_on_every_rank"]):
            bad.append(f"{key}: clipped {r['clipped']}, same on every rank "
                       f"{r['same_on_every_rank']}")
        if not (r["stats"] <= TOL and r["param"] <= TOL and r["eval"] <= TOL):
            bad.append(f"{key}: per-step stats differ by {r['stats']:.3g}, params by "
                       f"{r['param']:.3g}, eval loss by {r['eval']:.3g} (tolerance {TOL:g})")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_inf_gradient_on_one_rank_skips_the_step_on_every_rank(mesh_results: list[dict]) -> None:
    for rank, r in enumerate(mesh_results):
        s = r["skip"]
        assert s["skipped"] and s["norm"] == float("inf"), (rank, s)
        assert s["unchanged"] and s["lr_kept"], (rank, s)
        assert not s["next_skipped"], (rank, s)
