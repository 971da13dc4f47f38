"""Expert parallelism (--ep): the MoE model with its experts spread over EP ranks
carved from the DP ranks equals the one-process reference (the parity harness of
test_moe_parity: float64, LM loss, aux loss, every gradient and every parameter
within 1e-9), resumes exactly, and resumes onto another ep.

Default suite, a covering set: pp2 x dp2 at ep 2 with a V schedule (stp: the
all-to-alls braided); tp2 x dp2 at ep 2 with a classic one (1f1b) and the
sharded optimizer (experts TP-sharded inside each EP rank; the experts'
optimizer section over their singleton expert-data-parallel group); pp2 x dp2
at ep 2 with every forward's activations offloaded (what the layer's three
units share among them included: RouteUnit.kept_tensors). Slow: dp4
at ep 2 with the sharded optimizer (expert gradients reduce-scattered over two
replicas), and pp2 x tp2 x dp2 at ep 2 on every schedule (eight processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist import run_dist
from safetensors.torch import load_file
from test_moe_parity import CONFIG, SEQ, _check

from stp.models.hf import load as load_hf
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer

# -- the groups --------------------------------------------------------------------------


def test_ep_groups_are_consecutive_dp_ranks_and_edp_groups_their_replicas() -> None:
    dims = ParallelDims(pp=2, tp=2, dp=4, ep=2)  # rank = (pp * dp + dp_rank) * tp + tp_rank
    assert dims.ep_groups()[:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert dims.edp_groups()[:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert dims.edp == 2
    every = sorted(r for g in dims.ep_groups() for r in g)
    assert every == sorted(r for g in dims.edp_groups() for r in g) == list(range(16))
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelDims(dp=4, ep=3)


# -- parity -----------------------------------------------------------------------------


@pytest.mark.parametrize("mesh, names, options", [
    ((2, 1, 2, 2), ["stp"], {}),
    ((1, 2, 2, 2), ["1f1b"], {"shard_optimizer": True}),
    ((2, 1, 2, 2), ["stp"], {"offload": "all"}),
], ids=["pp2-dp2-ep2", "tp2-dp2-ep2-sharded", "pp2-dp2-ep2-offload"])
def test_expert_parallel_matches_the_reference(mesh, names, options) -> None:
    _check(mesh, names, **options)


@pytest.mark.slow
def test_expert_parallel_sharded_over_expert_replicas() -> None:
    _check((1, 1, 4, 2), ["1f1b", "stp"], shard_optimizer=True)


@pytest.mark.slow
def test_expert_parallel_on_every_schedule_of_the_eight_rank_mesh() -> None:
    _check((2, 2, 2, 2), registry.names())


# -- resume -----------------------------------------------------------------------------


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    tok = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def _trainer(mesh: Mesh, root: str | None = None, **options) -> Trainer:
    args = (CONFIG, _adamw, registry.make("stp", 2, 4))
    kw = {"mesh": mesh, "dtype": torch.float64, "timeout": 60, **options}
    return Trainer.resume(root, *args, **kw) if root else Trainer(*args, **kw)


def _resume_worker(rank: int, world: int, root: str) -> dict:
    rows = 2 * 4
    ep2 = Mesh.from_world(ParallelDims(2, 1, 2, 2), timeout=60)
    first = _trainer(ep2, trace=True)
    for step in range(2):
        first.step(_batch(step, rows))
    first.write_trace(f"{root}.trace.json")
    first.save(root)
    tail = [first.step(_batch(step, rows)) for step in (2, 3)]
    params = first.full_state_dict()
    first.save_full(f"{root}.safetensors")  # every EP rank's experts, written by their
    first.save_hf(f"{root}-hf")  # first replica
    out = {}
    if rank == 0:
        hf = load_hf(f"{root}-hf", torch.float64).state_dict()
        full = load_file(f"{root}.safetensors")
        out["written"] = [
            sorted(full) == sorted(params) and all(torch.equal(full[n], params[n])
                                                   for n in params),
            sorted(hf) == sorted(params) and all(torch.equal(hf[n], params[n])
                                                 for n in params)]
    if rank == 0:
        spans = json.loads(Path(f"{root}.trace.json").read_text())["traceEvents"]
        out["a2a"] = sum(1 for e in spans if e.get("name", "").endswith("A2A")
                         or e.get("args", {}).get("kind") == "A2A")
    for name, dims in (("ep2", ParallelDims(2, 1, 2, 2)), ("ep1", ParallelDims(2, 1, 2, 1))):
        mesh = ep2 if dims.ep == 2 else Mesh.from_world(dims, timeout=60)
        again = _trainer(mesh, root)
        steps_done = again.steps_done
        again_tail = [again.step(_batch(step, rows)) for step in (2, 3)]
        again_params = again.full_state_dict()
        if params is not None:
            out[name] = {
                "steps_done": steps_done,
                "loss": max(abs(a - b) for a, b in zip(tail, again_tail, strict=True)),
                "param": max(float((params[n] - again_params[n]).abs().max()) for n in params),
                "names": sorted(params) == sorted(again_params),
            }
    return out


def test_expert_parallel_resumes_exactly_and_onto_another_ep(tmp_path) -> None:
    """Whole-model files written at ep 2 hold every expert (save_full, save_hf). A
    checkpoint saved at ep 2 (each EP rank writes its experts under their global
    names) resumes at ep 2 bit for bit, and at ep 1 (every rank reads every expert)
    within float64 rounding: the AdamW moments of every expert came back. The braided
run's trace shows every expert all-to-all."""
    res = run_dist(_resume_worker, 4, str(tmp_path / "ckpt"), timeout=300)[0]
    # the trace of the braided run: per MoE layer and microbatch, the dispatch and the
    # combine forward and their two reverse exchanges backward, on each of dp 2 ranks
    assert res.pop("a2a") == 4 * len(CONFIG.moe_layers) * 4 * 2
    # --save-full and --save-hf hold every expert, equal to the gathered model
    assert res.pop("written") == [True, True]
    assert res["ep2"] == {"steps_done": 2, "loss": 0.0, "param": 0.0, "names": True}
    one = res["ep1"]
    assert one["steps_done"] == 2 and one["names"]
    assert one["loss"] < 1e-12 and one["param"] < 1e-12, one


# -- bf16: the main grads packed (stp.train.step.zero) -------------------------------------


def _bf16_worker(rank: int, world: int) -> dict:
    """Two bf16 steps at dp4, ep 2, unsharded and sharded: the sharded run keeps each
    section's main grads packed (the experts' over their two replicas)."""
    mesh = Mesh.from_world(ParallelDims(1, 1, 4, 2), timeout=60)
    params, packed = {}, []
    for shard in (False, True):
        trainer = Trainer(CONFIG, _adamw, registry.make("1f1b", 1, 4), mesh=mesh,
                          dtype=torch.bfloat16, timeout=60, shard_optimizer=shard)
        for step in range(2):
            trainer.step(_batch(step, 4 * 4))
        params[shard] = trainer.full_state_dict()
        packed = [len(pk.index) for pk in getattr(trainer.parts.precision, "packed", [])]
    same = params[False] is None or all(torch.equal(params[False][n], params[True][n])
                                        for n in params[False])
    return {"same": same, "packed": packed}


def test_bf16_sharded_with_packed_expert_grads_equals_unsharded() -> None:
    """bf16, dp4 at ep 2: the sharded optimizer, its dense and expert main grads kept
    packed and reduce-scattered in place, steps the same parameters bit for bit as
    the all-reduce of whole main grads (gloo sums the four dense replicas and the
    two expert ones in the same order either way)."""
    for got in run_dist(_bf16_worker, 4, timeout=300):
        assert got["same"]
        assert len(got["packed"]) == 2 and all(got["packed"])  # dense, then experts
