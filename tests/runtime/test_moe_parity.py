"""MoE parity: the distributed Trainer on an MoE model equals the one-process
reference (stp.models.moe.reference) trained on the whole global batch.

Model: 4 layers, 4 experts, top-2 not renormalised, a shared expert with its
gate, load-balancing coefficient 0.1 (large, so that a wrong aux gradient
shows), init_std 0.2 (decisive routing). Two SGD steps, float64: the LM loss,
the reported aux loss, every gradient after the first step and every
parameter after both within 1e-9 relative (observed ~5e-15). The reference
minimises loss + coef x aux with aux averaged over the MoE layers and the
dp x m microbatches; a negative control checks the aux term is in the
gradients (the reference without it differs by far more than the tolerance).

Default suite: pp2 with a V schedule (stp, braided) and a classic one (1f1b),
pp2 x tp2 with stp (experts TP-sharded, braided), dp2 with 1f1b. Slow: every
schedule on pp2, and pp2 x tp2 x dp2 (eight processes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist
from _parity import random_batch, rel, sgd

from stp.models.moe.reference import build_moe_reference
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.schedule.registry import make as make_schedule
from stp.shapes.moe import MoEConfig
from stp.train.step.trainer import Trainer

CONFIG = MoEConfig(
    vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3, init_std=0.2, num_experts=4, top_k=2, expert_ffn=16,
    shared_expert_ffn=24, norm_topk_prob=False, aux_loss_coef=0.1,
)
SEQ = 8
TOL = 1e-9


def _reference(batches, chunks: int, coef: float):
    ref = build_moe_reference(CONFIG, torch.float64)
    opt = sgd(list(ref.parameters()))
    losses, auxes, grads = [], [], {}
    for step, (tokens, targets) in enumerate(batches):
        opt.zero_grad()
        loss, aux = ref.objective(tokens, targets, chunks)
        (loss + coef * aux).backward()
        losses.append(loss.item())
        auxes.append(aux.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
    return losses, auxes, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _worker(rank: int, world: int, pp: int, tp: int, dp: int, names: list[str],
            ep: int = 1, options: dict | None = None) -> dict:
    mesh = Mesh.from_world(ParallelDims(pp, tp, dp, ep), timeout=60)
    out = {}
    for name in names:
        sch = make_schedule(name, pp)
        m = sch.num_microbatches
        trainer = Trainer(CONFIG, sgd, sch, mesh=mesh, dtype=torch.float64, timeout=60,
                          **(options or {}))
        batches = [random_batch(CONFIG.vocab_size, dp * m, SEQ, step) for step in range(2)]
        losses, figures = [trainer.step(batches[0])], [trainer.last_figures]
        grads = trainer.full_state_dict(grads=True)
        losses.append(trainer.step(batches[1]))
        figures.append(trainer.last_figures)
        params = trainer.full_state_dict()
        every = [None] * world
        dist.all_gather_object(every, figures)
        if rank != 0:
            continue
        ref_losses, ref_aux, ref_grads, ref_params = _reference(batches, dp * m,
                                                                CONFIG.aux_loss_coef)
        out[name] = {
            "loss": max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)),
            "aux": max(abs(f["aux_loss"] - b) / b for f, b in zip(figures, ref_aux,
                                                                   strict=True)),
            "grad": rel(grads, ref_grads),
            "param": rel(params, ref_params),
            "grad_without_aux": rel(grads, _reference(batches, dp * m, 0.0)[2]),
            "same_on_every_rank": all(e == figures for e in every),
            "expert_load": figures[0]["expert_load"],
            # every token's top-k choices in every MoE layer, spread over the experts
            "tokens_mean_error": figures[0]["expert_tokens_mean"] - len(CONFIG.moe_layers) * (
                dp * m * SEQ * CONFIG.top_k / CONFIG.num_experts),
            "tokens_max_over_mean": (figures[0]["expert_tokens_max"]
                                     / figures[0]["expert_tokens_mean"]),
        }
    return out


def _check(mesh: tuple[int, ...], names: list[str], **options: object) -> None:
    """mesh: (pp, tp, dp) or (pp, tp, dp, ep); options: the Trainer's."""
    pp, tp, dp, ep = (*mesh, 1)[:4]
    res = run_dist(_worker, pp * tp * dp, pp, tp, dp, names, ep, options, timeout=300)[0]
    assert set(res) == set(names)
    for name, r in res.items():
        print(mesh, name, {k: f"{v:.1e}" if isinstance(v, float) else v for k, v in r.items()})
        assert r["same_on_every_rank"], name
        # sharded, the DP mean of a gradient exists only as shards (the whole model's
        # gradients are each rank's own): the parameters after two steps check them
        sharded = options.get("shard_optimizer", False)
        for key in ("loss", "aux", "param") if sharded else ("loss", "aux", "grad", "param"):
            assert r[key] <= TOL, (name, key, r[key])
        assert sharded or r["grad_without_aux"] > 1e3 * TOL, name  # the aux gradient is there
        assert r["expert_load"] >= 1.0
        assert r["tokens_mean_error"] == 0, name
        assert r["tokens_max_over_mean"] == r["expert_load"], name


@pytest.mark.parametrize("mesh, names", [
    ((2, 1, 1), ["stp", "1f1b"]),
    ((2, 2, 1), ["stp"]),
    ((1, 1, 2), ["1f1b"]),
], ids=["pp2", "pp2-tp2", "dp2"])
def test_moe_matches_the_reference(mesh: tuple[int, int, int], names: list[str]) -> None:
    _check(mesh, names)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(2, 1, 1), (2, 2, 2)], ids=["pp2", "pp2-tp2-dp2"])
def test_moe_matches_the_reference_on_every_schedule(mesh: tuple[int, int, int]) -> None:
    _check(mesh, [n for n in registry.names() if mesh[0] >= registry.get(n).min_ranks])
