"""The DP gradient reduction overlapped with the backward (`overlap_grad_sync`, the
default; stp.train.step.grad_sync, stp.runtime.executor's `grads_final`).

pp2 x dp2, float64, two SGD steps on the tied decoder (its embedding and head
gradients summed between the pipeline ranks, so the shared sum meets the
early reductions): with the overlap on, the losses, the gradients after the
first step and the parameters after both equal the one-process reference
within 1e-9, on 1F1B (each rank's only stage ends last) and on ZB-V (deferred
W; rank 0 holds stages 0 and 3, and stage 3's last W comes long before the
step ends), on ZB-V with the sharded optimizer too (its gradient shards equal
the rows of the unsharded run's DP mean; the tied embedding and head are
reduce-scattered after their sum, the rest during the backward). In bfloat16 (mixed precision: the
stage's bf16 gradients folded into fp32 main grads before its reduction) the
overlap changes nothing: losses and parameters equal the run without it bit
for bit (untied model: nothing summed across ranks, and at dp2 each element is
the same two fp32 numbers added either way).

Launched before the pipeline drains: in the trace of the ZB-V run, every
stage whose last gradient pass is not its rank's last action has its DP
reduction start before that last action starts; without the overlap none
does (the same check fails, so it can).

Slow: every schedule at pp2 x dp2, sharded and not (1F1B sharded among them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist
from _parity import LEVER_MODELS, compare_with_reference, random_batch, sgd

from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer

TIED, UNTIED = LEVER_MODELS["tied"], LEVER_MODELS["untied"]
SEQ, M, TOL = 8, 4, 1e-9
CASES = [("1f1b", False), ("zb-v", False), ("zb-v", True)]
"""The default run's; 1F1B with the sharded optimizer and every other schedule: slow."""


def _batches(config, rows: int) -> list:
    return [random_batch(config.vocab_size, rows, SEQ, step) for step in range(2)]


def _trainer(mesh: Mesh, config, schedule: str, shard: bool, **kw) -> Trainer:
    return Trainer(config, sgd, registry.make(schedule, 2, M), mesh=mesh, timeout=60,
                   shard_optimizer=shard, **{"dtype": torch.float64, **kw})


def _run(mesh: Mesh, config, schedule: str, shard: bool, **kw) -> dict:
    trainer = _trainer(mesh, config, schedule, shard, **kw)
    batches = _batches(config, 2 * M)
    first = trainer.step(batches[0])
    shards = [g.clone() for g in trainer.parts.precision.grads()]
    grads = trainer.full_state_dict(grads=True)
    second = trainer.step(batches[1])
    return {"trainer": trainer, "losses": [first, second], "grads": grads, "shards": shards,
            "params": trainer.full_state_dict(), "batches": batches}


def _launched_early(trainer: Trainer) -> list[tuple[int, bool]]:
    """(stage, its DP reduction started before the rank's last action did) for each
    stage of this rank whose last gradient pass is not the rank's last action."""
    rec, ex = trainer.parts.executor.recorder, trainer.parts.executor
    spans = rec.spans()
    compute = [s for s in spans if s.lane == "compute"]
    last = max(s.action_index for s in compute)
    last_start = min(s.start for s in compute if s.action_index == last)
    out = []
    for stage, index in ex.last_grad_action.items():
        if index < last:
            starts = [s.start for s in spans if s.lane == "dp" and s.stage == stage]
            out.append((stage, bool(starts) and min(starts) < last_start))
    return out


def _worker(rank: int, world: int, cases: list[tuple[str, bool]], bf16: bool) -> dict:
    mesh = Mesh.from_world(ParallelDims(2, 1, 2), timeout=60)
    out: dict = {"cases": {}}
    for schedule, shard in cases:
        run = _run(mesh, TIED, schedule, shard, trace=schedule == "zb-v" and not shard)
        plain = run if not shard else _run(mesh, TIED, schedule, False,
                                           overlap_grad_sync=False)
        dp = mesh.coord.dp
        splits = getattr(run["trainer"].parts.precision, "layout", None)
        rows = plain["shards"] if splits is None else [
            g[slice(*s.rows_of(dp))] for g, s in zip(plain["shards"], splits.splits,
                                                     strict=True)]
        shard_error = max(float((a - b).abs().max()) for a, b in
                          zip(run["shards"], rows, strict=True))
        every = [None] * world
        dist.all_gather_object(every, run["losses"])
        case = {"same_on_every_rank": all(e == run["losses"] for e in every),
                "shard_error": shard_error}
        if run["trainer"].parts.options.trace:
            case["early"] = _launched_early(run["trainer"])
            off = _run(mesh, TIED, schedule, shard, trace=True, overlap_grad_sync=False)
            case["early_without_overlap"] = _launched_early(off["trainer"])
        if rank == 0:
            grads = dict(run["grads"] if not shard else plain["grads"])
            params = dict(run["params"])
            for d in (grads, params):  # one tensor in the reference: both copies equal it
                case["tied_equal"] = torch.equal(d.pop("head.weight"), d["embed.weight"])
            case.update(compare_with_reference(TIED, torch.float64, run["batches"],
                                               run["losses"], grads, params))
        out["cases"][(schedule, shard)] = case
    if bf16:
        runs = [_run(mesh, UNTIED, "zb-v", False, dtype=torch.bfloat16, overlap_grad_sync=on)
                for on in (True, False)]
        out["bf16_same"] = runs[0]["losses"] == runs[1]["losses"] and (
            runs[0]["params"] is None or all(torch.equal(runs[0]["params"][n],
                                                         runs[1]["params"][n])
                                             for n in runs[0]["params"]))
    return out


def _check(res: list[dict], cases: list[tuple[str, bool]]) -> None:
    for key in cases:
        r = res[0]["cases"][key]
        print(key, {k: v for k, v in r.items() if k in ("loss", "grad", "param")})
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["param"] <= TOL, (key, r)
        assert r["tied_equal"], key
        for rank in res:
            c = rank["cases"][key]
            assert c["same_on_every_rank"] and c["shard_error"] <= TOL, (key, c)


@pytest.fixture(scope="module")
def default_runs() -> list[dict]:
    return run_dist(_worker, 4, CASES, True, timeout=600)


def test_overlapped_steps_equal_the_one_process_reference(default_runs: list[dict]) -> None:
    _check(default_runs, CASES)


def test_a_stage_whose_last_w_is_early_is_reduced_before_the_pipeline_drains(
        default_runs: list[dict]) -> None:
    early = [s for r in default_runs for s in r["cases"][("zb-v", False)]["early"]]
    assert early, "ZB-V at pp2: rank 0's stage 3 ends before its stage 0"
    assert all(ok for _, ok in early), early
    late = [s for r in default_runs for s in r["cases"][("zb-v", False)]["early_without_overlap"]]
    assert late and not any(ok for _, ok in late), late


def test_bf16_overlap_changes_nothing(default_runs: list[dict]) -> None:
    assert all(r["bf16_same"] for r in default_runs)


@pytest.mark.slow
def test_every_schedule_overlapped_equals_the_reference() -> None:
    names = [n for n in registry.names() if registry.get(n).min_ranks <= 2]
    cases = [(n, shard) for n in names for shard in (False, True)]
    _check(run_dist(_worker, 4, cases, False, timeout=1800), cases)
