"""Activation recomputation in the runtime (`--recompute`, stp.models.recompute) changes
what a forward keeps, never the maths: float64 losses, first-step gradients and
parameters after two SGD steps equal the single-process reference within 1e-9
of each tensor's magnitude (the criterion of test_parity.py), and equal the
run without recomputation within 1e-12, on pp2 x tp2 with the braided stp
schedule (braided full backwards: W between a unit's B halves) and 1f1b, with
sequence parallelism, with offload and a tied embedding, on pp2 x dp2, and on
the multimodal model (its encoder and merger recompute too: with its
sequence-parallel encoder under stp and under zb-v's deferred W with offload,
and selective under 1f1b). The same runs measure the resident activation bytes of
a step on every rank: full keeps strictly fewer than none, selective no more.
The full matrix (every schedule x selective, full x plain, SP, offload, the
multimodal model) is behind `-m slow`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist
from _parity import (
    LEVER_MODELS,
    LeverCase,
    compare_with_reference,
    mllm_reference,
    mllm_setup,
    random_batch,
    rel,
    sgd,
    two_steps,
)

from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer, TrainerOptions

MODELS = LEVER_MODELS
CONFIG, TIED = MODELS["untied"], MODELS["tied"]
SEQ = 8
TOL = 1e-9
SAME = 1e-12

Case = LeverCase


def _one(mesh: Mesh, case: Case) -> tuple[list[float], dict | None, dict | None, list | None]:
    dims, name, mode, sp, offload, model = case
    if model == "mllm":
        config, data = mllm_setup()
        batches = [data.batch(s) for s in range(2)]
        sch = registry.make(name, dims[0], 4)
    else:
        config = MODELS[model]
        sch = registry.make(name, dims[0])
        rows = sch.num_microbatches * dims[2]
        batches = [random_batch(config.vocab_size, rows, SEQ, s) for s in range(2)]
    trainer = Trainer(config, sgd, sch, mesh=mesh,
                      options=TrainerOptions(recompute=mode, sequence_parallel=sp,
                                                       offload=offload, dtype=torch.float64,
                                                       timeout=60))
    losses, grads, params = two_steps(trainer, batches)
    peaks = trainer.activation_peaks()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    assert all(e == losses for e in every), every
    if grads is None:
        return losses, None, None, peaks
    if model == "mllm":
        ref = mllm_reference(config, batches)
        diffs = {"loss": max(abs(a - b) / abs(b) for a, b in
                             zip(losses, ref["losses"], strict=True)),
                 "grad": rel(grads, ref["grads"]), "param": rel(params, ref["params"])}
    else:
        if config.tie_embeddings:  # one tensor in the reference: both copies must equal it
            for d in (grads, params):
                assert torch.equal(d.pop("head.weight"), d["embed.weight"])
        diffs = compare_with_reference(config, torch.float64, batches, losses, grads, params)
    return losses, grads, diffs, peaks


def _worker(rank: int, world: int, cases: list[Case]) -> dict:
    meshes: dict[tuple[int, int, int], Mesh] = {}
    plain: dict = {}  # the run without recomputation of a setting, when one is listed first
    out = {}
    for case in cases:
        dims, name, mode, sp, offload, model = case
        if dims not in meshes:  # every rank builds the meshes in the same order
            meshes[dims] = Mesh.from_world(ParallelDims(*dims), timeout=60)
        losses, grads, diffs, peaks = _one(meshes[dims], case)
        if rank != 0:
            continue
        setting = (dims, name, sp, offload, model)
        if mode == "none":
            plain[setting] = (losses, grads)
        elif setting in plain:  # only numbers go back (tensors die with the process)
            base_losses, base_grads = plain[setting]
            diffs = {**diffs, "vs none loss": max(
                abs(a - b) / abs(b) for a, b in zip(losses, base_losses, strict=True)),
                "vs none grad": rel(grads, base_grads)}
        out[case] = {"diffs": diffs, "peaks": peaks}
    return out


def _run(cases: list[Case]) -> dict:
    return run_dist(_worker, 4, cases, timeout=600)[0]


def _assert_reference(res: dict) -> None:
    bad = []
    for case, r in res.items():
        print(case, {k: f"{v:.1e}" for k, v in r["diffs"].items()}, "peaks", r["peaks"])
        bad += [f"{case}: {k} differs by {v:.3g}" for k, v in r["diffs"].items()
                if not v <= (SAME if k.startswith("vs none") else TOL)]
    assert not bad, "\n".join(bad)


PP2_TP2 = (2, 2, 1)
MEASURED = [(PP2_TP2, "stp", mode, False, "none", "untied")
            for mode in ("none", "selective", "full")]
COVERING = [
    *MEASURED,
    (PP2_TP2, "1f1b", "selective", False, "none", "untied"),
    (PP2_TP2, "1f1b", "full", False, "none", "untied"),
    (PP2_TP2, "stp", "full", True, "none", "untied"),   # sequence parallelism
    (PP2_TP2, "stp", "full", False, "stp", "tied"),     # offload, tied embedding
    ((2, 1, 2), "1f1b", "full", False, "none", "tied"),  # pp2 x dp2
    # the multimodal model: its encoder's units and merger recompute too, with its
    # sequence-parallel encoder (the image rows cut between the TP ranks), under the
    # braided stp schedule, under zb-v's split backward (W deferred) with offload, and
    # without SP under 1f1b
    (PP2_TP2, "stp", "none", True, "none", "mllm"),
    (PP2_TP2, "stp", "full", True, "none", "mllm"),
    (PP2_TP2, "zb-v", "full", True, "stp", "mllm"),
    (PP2_TP2, "1f1b", "selective", False, "none", "mllm"),
]


def test_recompute_equals_reference_and_full_keeps_fewer_bytes() -> None:
    res = _run(COVERING)
    assert len(res) == len(COVERING), sorted(res)
    _assert_reference(res)
    none, sel, full = (res[c] for c in MEASURED)
    for other in (sel, full):  # the same maths as without recomputation (checked above)
        assert {"vs none loss", "vs none grad"} <= set(other["diffs"])
    # resident activation bytes of a step, per rank (the offloader's measurement)
    assert len(none["peaks"]) == 4 and min(none["peaks"]) > 0
    for rank, (n, s, f) in enumerate(zip(none["peaks"], sel["peaks"], full["peaks"],
                                         strict=True)):
        assert f < n, f"rank {rank}: full keeps {f} bytes, none {n}"
        assert s <= n, f"rank {rank}: selective keeps {s} bytes, none {n}"


@pytest.mark.slow
def test_every_schedule_with_selective_and_full_plain_sp_offload() -> None:
    names = [n for n in registry.names() if registry.get(n).min_ranks <= 2]
    cases = [(PP2_TP2, n, mode, sp, off, model) for n in names
             for mode in ("selective", "full")
             for sp, off, model in ((False, "none", "untied"), (True, "none", "untied"),
                                    (False, "stp", "tied"), (True, "all", "tied"),
                                    (False, "none", "mllm"), (True, "stp", "mllm"))]
    res = _run(cases)
    assert len(res) == len(cases)
    _assert_reference(res)
