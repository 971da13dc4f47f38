"""The memory levers together change no maths: sequence parallelism, each activation
recomputation mode and the sharded optimizer, alone and together, on a Hugging Face
Llama and Qwen2 built by transformers (loaded with init_from; tests/models/_hf.py)
and on the multimodal model. Two float64 SGD steps: the losses, the first step's
gradients and the parameters after both equal the single-process model within 1e-9
of each tensor's magnitude (the criterion of test_hf_dist), and every rank reports
the same losses.

Meshes: pp2 x tp2 (SP and recomputation; the sharded optimizer is the identity at
dp 1), pp2 x dp2 (recomputation and the sharded optimizer; SP is the identity at
tp 1), and tp2 x dp2, where all three act at once on four processes. With the
sharded optimizer at dp 2 the DP-mean gradient exists only as shards, so the first
step's gradient is read back from its SGD update, (p0 - p1) / lr (momentum starts
from zero: the first update is lr x gradient).

Default run: a covering set, two cases per model family: one V schedule (stp,
braided) and one classic (1f1b), selective and full, SP, the sharded optimizer,
and SP + recomputation + sharded optimizer together once per family. Behind
`-m slow`: every schedule on both pp2 meshes with every combination, and
pp2 x tp2 x dp2 (eight processes) with all three together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist
from _parity import mllm_reference, mllm_setup, rel
from _parity import sgd as mllm_sgd
from test_hf_dist import _batch, _compare, _sgd

from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer

TOL = 1e-9
LR = {"llama": 0.1, "qwen2": 0.1, "mllm": 0.5}  # _sgd's and _parity.sgd's
FAMILIES = ("llama", "qwen2", "mllm")
PP2_TP2, PP2_DP2, TP2_DP2, PP2_TP2_DP2 = (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)

# (model family, mesh (pp, tp, dp), schedule, sequence parallel, recompute, shard optimizer)
Case = tuple[str, tuple[int, int, int], str, bool, str, bool]


def _trainer(mesh: Mesh, case: Case, paths: dict[str, str]) -> tuple[Trainer, list]:
    family, dims, schedule, sp, mode, shard = case
    levers = dict(mesh=mesh, microbatches=4, dtype=torch.float64, timeout=60,
                  sequence_parallel=sp, recompute=mode, shard_optimizer=shard)
    if family == "mllm":
        cfg, data = mllm_setup(rows=4 * dims[2])
        return Trainer(cfg, mllm_sgd, schedule, **levers), [data.batch(s) for s in range(2)]
    return (Trainer(None, _sgd, schedule, init_from=paths[family], **levers),
            [_batch(0), _batch(1)])


def _two_steps(trainer: Trainer, batches: list, lr: float,
               sharded: bool) -> tuple[list[float], dict | None, dict | None]:
    """Losses of two steps, the first step's gradients, the parameters after both (on
    global rank 0; None elsewhere). Collective."""
    before = trainer.full_state_dict() if sharded else None
    losses = [trainer.step(batches[0])]
    if sharded:  # the DP-mean gradient exists as shards only: read it off the update
        after = trainer.full_state_dict()
        grads = None if after is None else {n: (before[n] - after[n]) / lr for n in after}
    else:
        grads = trainer.full_state_dict(grads=True)
    losses.append(trainer.step(batches[1]))
    return losses, grads, trainer.full_state_dict()


def _one(mesh: Mesh, case: Case, paths: dict[str, str]) -> dict | None:
    family, dims = case[0], case[1]
    trainer, batches = _trainer(mesh, case, paths)
    sharded = case[5] and dims[2] > 1
    losses, grads, params = _two_steps(trainer, batches, LR[family], sharded)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    if grads is None:
        return None
    same = all(e == losses for e in every)
    if family != "mllm":
        return {"same": same, **_compare(paths[family], losses, grads, params)}
    ref = mllm_reference(trainer.parts.model_config, batches, mllm_sgd)
    return {"same": same,
            "loss": max(abs(a - b) / abs(b) for a, b in
                        zip(losses, ref["losses"], strict=True)),
            "grad": rel(grads, ref["grads"]), "param": rel(params, ref["params"])}


def _worker(rank: int, world: int, cases: list[Case], paths: dict[str, str]) -> dict:
    meshes: dict[tuple[int, int, int], Mesh] = {}
    out = {}
    for case in cases:
        if case[1] not in meshes:  # every rank builds the meshes in the same order
            meshes[case[1]] = Mesh.from_world(ParallelDims(*case[1]), timeout=60)
        result = _one(meshes[case[1]], case, paths)
        if result is not None:
            out[case] = result
    return out


def _assert_exact(cases: list[Case], paths: dict[str, str], world: int = 4,
                  timeout: float = 900) -> None:
    res = run_dist(_worker, world, cases, paths, timeout=timeout)[0]
    assert sorted(res) == sorted(cases), sorted(set(cases) ^ set(res))
    bad = []
    for case, r in sorted(res.items()):
        print(case, {k: f"{r[k]:.1e}" for k in ("loss", "grad", "param")})
        if not r["same"]:
            bad.append(f"{case}: ranks returned different losses")
        bad += [f"{case}: {k} differs by {r[k]:.3g}" for k in ("loss", "grad", "param")
                if not r[k] <= TOL]
    assert not bad, "\n".join(bad)


def _paths(checkpoints: dict[str, Path]) -> dict[str, str]:
    return {k: str(v) for k, v in checkpoints.items()}


COVERING: list[Case] = [
    # each family: both pp2 meshes between them (the multimodal model at pp2 x tp2 is
    # test_recompute_runtime's), SP, selective and full, the sharded optimizer, stp and
    # 1f1b, and the three levers acting at once on tp2 x dp2
    ("llama", PP2_TP2, "stp", True, "selective", False),
    ("llama", TP2_DP2, "1f1b", True, "full", True),
    ("qwen2", PP2_DP2, "1f1b", False, "selective", True),
    ("qwen2", TP2_DP2, "stp", True, "full", True),
    ("mllm", PP2_DP2, "stp", False, "full", True),
    ("mllm", TP2_DP2, "1f1b", True, "selective", True),
]


def test_sp_recompute_and_sharded_optimizer_equal_one_process(
    checkpoints: dict[str, Path]
) -> None:
    _assert_exact(COVERING, _paths(checkpoints))


def _matrix(family: str) -> list[Case]:
    names = [n for n in registry.names() if registry.get(n).min_ranks <= 2]
    tp = [(sp, mode) for sp in (False, True) for mode in ("none", "selective", "full")
          if sp or mode != "none"]
    dp = [(shard, mode) for shard in (False, True) for mode in ("none", "selective", "full")
          if shard or mode != "none"]
    return [*((family, PP2_TP2, n, sp, mode, False) for n in names for sp, mode in tp),
            *((family, PP2_DP2, n, False, mode, shard) for n in names for shard, mode in dp)]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_schedule_every_combination(family: str, checkpoints: dict[str, Path]) -> None:
    _assert_exact(_matrix(family), _paths(checkpoints), timeout=3600)


@pytest.mark.slow
def test_pp2_tp2_dp2_all_three_together(checkpoints: dict[str, Path]) -> None:
    cases = [(f, PP2_TP2_DP2, n, True, mode, True) for f in FAMILIES
             for n, mode in (("stp", "full"), ("1f1b", "selective"))]
    _assert_exact(cases, _paths(checkpoints), world=8, timeout=1800)
