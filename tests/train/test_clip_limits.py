"""Gradient clipping below and above its limit, with a tied embedding and head,
against torch.nn.utils.clip_grad_norm_ on the reference model's gradients.

float64, SGD with momentum (its update is proportional to the gradient, so a
wrong clipping factor moves the parameters; Adam's would nearly hide it), two
steps, 2 sequences per microbatch. Each step's loss and grad_norm (before
clipping), the clipped gradients of the first step and the parameters after
the second equal the reference's within 1e-9, with the limit above every
step's norm (nothing is clipped) and below it (every step is clipped).

The model ties its embedding and head: the reference holds one tensor, stp a
copy on each stage that needs it, both given the summed gradient, to be
counted ONCE in the norm (stp.train.step.clip). Both copies on one rank: pp1 (one
stage holds both) and ZB-V, whose V puts the first and the last stage on rank
0 (at pp1 its two stages, at pp2 stages 0 and 3). Across ranks: pp2 (ZB-V) and
tp2 (1F1B; RMSNorm gains and the one kv head replicated on both TP ranks), the
default suite's multi-rank clip parity (test_clip_parity.py's schedule matrix
is behind -m slow).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_dist
from _parity import random_batch, rel, sgd

from stp.models import ModelConfig, build_reference
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer

TIED = ModelConfig(
    vocab_size=30, hidden=32, num_layers=4, num_heads=4, num_kv_heads=1, ffn_hidden=64,
    max_seq_len=16, seed=5, tie_embeddings=True, qkv_bias=True,
)
SEQ, PER_MICROBATCH = 8, 2
LIMITS = {"below": 1e3, "above": 0.05}
"""The limit relative to the gradient norm (about 1 to 3 here): "below" never clips."""
TOL = 1e-9


def _batches(microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [random_batch(TIED.vocab_size, PER_MICROBATCH * microbatches, SEQ, s)
            for s in range(2)]


def reference(limit: float, microbatches: int) -> dict:
    """Two SGD steps of the single-process model with torch's clip_grad_norm_."""
    model = build_reference(TIED, torch.float64)
    opt = sgd(list(model.parameters()))
    out: dict = {"stats": []}
    for step, (tokens, targets) in enumerate(_batches(microbatches)):
        opt.zero_grad()
        loss = model.loss(tokens, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        out["stats"].append((loss.item(), float(norm)))
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _untie(full: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """stp's two copies of the tied tensor must be equal; the reference has one."""
    if full is not None:
        head = full.pop("head.weight")
        assert torch.equal(head, full["embed.weight"]), "the tied copies differ"
    return full


def run_stp(trainer: Trainer, limit: float) -> dict:
    """The same two steps in stp (every rank calls it; the result is whole on rank 0)."""
    out: dict = {"stats": []}
    for step, batch in enumerate(_batches(trainer.parts.schedule.num_microbatches)):
        loss = trainer.step(batch)
        out["stats"].append((loss, trainer.last_update.grad_norm))
        if step == 0:  # clipped in place: what the optimizer stepped with
            out["grads"] = _untie(trainer.full_state_dict(grads=True))
    out["params"] = _untie(trainer.full_state_dict())
    return out


def compare(got: dict, limit: float, microbatches: int) -> dict:
    """Relative differences from the reference; whether each step's norm was on the
    side of the limit its case names."""
    ref = reference(limit, microbatches)
    return {
        "stats": max(abs(a - b) / abs(b) for s, r in zip(got["stats"], ref["stats"],
                                                          strict=True)
                     for a, b in zip(s, r, strict=True)),
        "grad": rel(got["grads"], ref["grads"]),
        "param": rel(got["params"], ref["params"]),
        "norms": [n for _, n in ref["stats"]],
    }


def _check(case: str, side: str, r: dict) -> list[str]:
    limit = LIMITS[side]
    bad = []
    if not all((n > limit) == (side == "above") for n in r["norms"]):
        bad.append(f"{case} {side}: the norms {r['norms']} are not all {side} {limit}")
    bad += [f"{case}, limit {side} the norm: {k} differs by {r[k]:.3g} (tolerance {TOL:g})"
            for k in ("stats", "grad", "param") if not r[k] <= TOL]
    return bad


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
@pytest.mark.parametrize("side", ["below", "above"])
def test_one_rank_holding_embedding_and_head(schedule: str, side: str) -> None:
    """Bugs guarded: clipping when the norm is below the limit (a factor above 1);
    the tied gradient counted twice when one rank holds both copies (pp1: one stage;
    ZB-V: the first and the last stage)."""
    trainer = Trainer(TIED, sgd, registry.make(schedule, 1, 2), pp=1, dtype=torch.float64,
                      clip_grad=LIMITS[side])
    r = compare(run_stp(trainer, LIMITS[side]), LIMITS[side],
                trainer.parts.schedule.num_microbatches)
    print(schedule, side, {k: f"{r[k]:.1e}" for k in ("stats", "grad", "param")})
    bad = _check(f"pp1 {schedule}", side, r)
    assert not bad, "\n".join(bad)


MESHES = {"pp2 zb-v": ((2, 1, 1), "zb-v"), "tp2 1f1b": ((1, 2, 1), "1f1b")}


def _mesh_worker(rank: int, world: int) -> dict:
    out = {}
    for case, (dims, schedule) in MESHES.items():
        mesh = Mesh.from_world(ParallelDims(*dims), timeout=60)
        sch = registry.make(schedule, dims[0], 2 * dims[0])
        for side, limit in LIMITS.items():
            trainer = Trainer(TIED, sgd, sch, mesh=mesh, dtype=torch.float64, timeout=60,
                              clip_grad=limit)
            got = run_stp(trainer, limit)
            if rank == 0:
                out[(case, side)] = compare(got, limit, sch.num_microbatches)
    return out


def test_pp2_zbv_and_tp2_equal_torch_clipping_below_and_above() -> None:
    """Bugs guarded: the norm's world sum skipped or a replicated gradient (a tied copy
    on another pipeline rank, an RMSNorm gain or kv head on both TP ranks) counted on
    every rank that holds it; clipping below the limit."""
    res = run_dist(_mesh_worker, 2, timeout=300)[0]
    assert set(res) == {(c, s) for c in MESHES for s in LIMITS}
    bad = []
    for (case, side), r in sorted(res.items()):
        print(case, side, {k: f"{r[k]:.1e}" for k in ("stats", "grad", "param")})
        bad += _check(case, side, r)
    assert not bad, "\n".join(bad)
