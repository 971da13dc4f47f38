"""Sequence parallelism for the multimodal model (stp.models.mllm.rows): at pp2 x tp2
the float64 losses, first-step gradients and parameters after two SGD steps equal the
single-process reference (stp.models.mllm.reference) within 1e-9 of each tensor's
magnitude, on the braided STP schedule, on 1f1b, and with offload once. The packed
sequence (16 image tokens + 6 caption tokens = 22 rows) splits 11 / 11, so the
image rows are cut between the two TP ranks (rank 1 holds 5 image rows and the
caption). A planted bug (a rank's position-embedding gradient added at the first
rows, not at its own) must fail the same comparison. The braided run's measured
trace names the reduce-scatters (RS) and all-gathers (AG), shows some of each
under the partner pass's compute, and `stp draw --measured` draws them. An S that
does not divide by tp is refused in one line naming the --seq-len that would fit.
The full schedule matrix is behind `-m slow`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist

from stp.cli.main import main
from stp.models import ModelConfig
from stp.models.mllm import vision_input
from stp.models.mllm.reference import build_mllm_reference
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.shapes.mllm import MLLMConfig, VisionConfig
from stp.train.data.images import CaptionBatches, ShapeImages
from stp.train.step.trainer import Trainer
from stp.viz.measured_read import load_measured_trace

DEC = ModelConfig(vocab_size=256, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_hidden=64, max_seq_len=32, seed=4)
CFG = MLLMConfig(VisionConfig(image_size=16, patch_size=2, merge=2, hidden=8, num_layers=2,
                              num_heads=2), DEC)
TEXT = 6  # 16 image tokens + 6 = 22 rows: 11 per TP rank
TOL = 1e-9

Case = tuple[str, bool, "str | None"]  # schedule, braid, offload


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = CaptionBatches(ShapeImages(16, seed=7), CFG, text_len=TEXT, batch_size=rows)
    out = []
    for step in range(2):
        out.append(data.batch(step))
    return out


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-300)) for n in b)


def _reference(batches) -> tuple[list[float], dict, dict]:
    ref = build_mllm_reference(CFG, torch.float64)
    opt = sgd(list(ref.parameters()))
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(batches):
        opt.zero_grad()
        loss = ref.loss(inputs, targets)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_full().items()}
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in ref.named_full().items()}


def _case(rank: int, world: int, mesh: Mesh, case: Case, trace: str | None) -> dict | None:
    """Two SGD steps of one case on this mesh; rank 0 returns the differences."""
    name, braid, offload = case
    sch = registry.make(name, 2)
    trainer = Trainer(CFG, sgd, sch, mesh=mesh, dtype=torch.float64, timeout=60,
                      sequence_parallel=True, braid=braid, offload=offload, trace=True)
    batches = _batches(sch.num_microbatches)
    losses = [trainer.step(batches[0])]
    grads = trainer.full_state_dict(grads=True)
    losses.append(trainer.step(batches[1]))
    params = trainer.full_state_dict()
    if trace is not None:  # collective: the last step's spans of every rank
        trainer.write_trace(trace)
    every = [None] * world
    dist.all_gather_object(every, losses)
    if rank != 0:
        return None
    ref_losses, ref_grads, ref_params = _reference(batches)
    return {"same": all(e == losses for e in every),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
            "grad": _rel(grads, ref_grads), "param": _rel(params, ref_params),
            "advanced": trainer.parts.executor.runner.stats.advanced}


def _worker(rank: int, world: int, cases: list[Case], planted: Case | None,
            trace: str | None) -> dict:
    """Every case on one mesh (one spawn); the first case's trace to `trace`; then
    `planted` with the planted bug."""
    mesh = Mesh.from_world(ParallelDims(2, 2, 1), timeout=60)
    out = {case: _case(rank, world, mesh, case, trace if k == 0 else None)
           for k, case in enumerate(cases)}
    if planted is not None:
        vision_input.AddGrad.accumulate = _rows_at_zero
        out[("planted", *planted)] = _case(rank, world, mesh, planted, None)
    return out


def _rows_at_zero(self) -> None:
    """Planted: a rank's position gradient added at the first rows, whichever rows
    of the image it holds."""
    g = self.grad_out.sum(0)
    if self.weight.grad is None:
        self.weight.grad = torch.zeros_like(self.weight)
    self.weight.grad.narrow(0, 0, g.shape[0]).add_(g)


def _run(cases: list[Case], planted: Case | None = None, trace: str | None = None) -> dict:
    return run_dist(_worker, 4, cases, planted, trace, timeout=300)[0]


def _assert_exact(res: dict, expected: int) -> None:
    assert len(res) == expected, sorted(res, key=str)
    bad = []
    for case, r in sorted(res.items(), key=str):
        print(case, {k: f"{r[k]:.1e}" for k in ("loss", "grad", "param")}, r["advanced"])
        if not r["same"]:
            bad.append(f"{case}: ranks returned different losses")
        bad += [f"{case}: {k} differs by {r[k]:.3g}" for k in ("loss", "grad", "param")
                if not r[k] <= TOL]
    assert not bad, "\n".join(bad)


COVERING = [("stp", True, None), ("1f1b", True, None), ("stp", True, "stp")]


@pytest.fixture(scope="module")
def covering(tmp_path_factory) -> tuple[dict, Path]:
    """The covering cases, their braided STP run's trace, and the planted bug: one
    spawn for the three tests that read them."""
    trace = tmp_path_factory.mktemp("sp") / "stp.json"
    return _run(COVERING, planted=("1f1b", True, None), trace=str(trace)), trace


def test_pp2_tp2_braided_stp_1f1b_and_offload_equal_one_process(covering):
    res, _ = covering
    _assert_exact({k: v for k, v in res.items() if k[0] != "planted"}, len(COVERING))
    # the braided schedule launched all-gathers early (the runner's advance): that
    # path, through encoder, merger and decoder units, is what parity covered
    assert res[("stp", True, None)]["advanced"] > 0


def test_position_gradient_at_the_wrong_rows_fails_parity(covering):
    res, _ = covering
    assert res[("planted", "1f1b", True, None)]["grad"] > 1e-3, res


def _overlaps(spans, rank: int, kind: str) -> int:
    """Braided tp spans of `kind` on `rank` that overlap a compute span of the other
    pass of their block."""
    compute = defaultdict(list)
    for s in spans:
        if s.rank == rank and s.lane == "compute":
            compute[s.action_index].append(s)
    return sum(
        any(c.name != s.name and c.start < s.end and s.start < c.end
            for c in compute[s.action_index])
        for s in spans if s.rank == rank and s.lane == "tp" and s.kind == kind and s.braided)


def test_braided_sp_trace_names_rs_and_ag_hides_them_and_draws_them(covering, tmp_path):
    """The braided STP run's measured trace: every rank's TP lane holds RS (the
    reduce-scatter ending each unit) and AG (the all-gather starting one), AR only for
    the loss statistics (the V puts the loss on pipeline rank 0); in braided blocks
    some RS and some AG of every rank run while the partner pass computes (STP paper,
    arXiv 2510.27257, Fig. 3); `stp draw --measured` draws each by name."""
    _, path = covering
    trace = load_measured_trace(path)
    for rank in range(4):
        kinds = {s.kind for s in trace.spans if s.rank == rank and s.lane == "tp"}
        assert kinds == ({"AR", "RS", "AG"} if rank < 2 else {"RS", "AG"}), (rank, kinds)
        assert _overlaps(trace.spans, rank, "RS") > 0, rank
        assert _overlaps(trace.spans, rank, "AG") > 0, rank
    svg = tmp_path / "sp.svg"
    assert main(["draw", "--measured", str(path), "--out", str(svg)]) == 0
    text = svg.read_text()
    for needle in ("reduce-scatter (RS)", "all-gather (AG)", "TP all-reduce", "RS of 0F",
                   "AG of 0F", "under compute", "braided block"):
        assert needle in text, needle


@pytest.mark.slow
def test_pp2_tp2_every_schedule_braided_unbraided_offload():
    names = [n for n in registry.names() if registry.get(n).min_ranks <= 2]
    cases = [(n, b, o) for n in names for b, o in ((True, None), (False, None), (True, "stp"))]
    _assert_exact(_run(cases), len(cases))


# 12-pixel images of 2-pixel patches merged 2 x 2: 9 image tokens before the caption
SHAPE = ["--arch", "mllm", "--layers", "2", "--hidden", "32", "--heads", "4",
         "--vision-layers", "2", "--image-size", "12", "--patch", "2", "--vision-hidden", "8",
         "--microbatch-size", "1", "-m", "4", "--steps", "1", "--sequence-parallel",
         "--pp", "2", "--tp", "2"]


def test_image_tokens_plus_caption_not_divisible_by_tp_is_refused_in_one_line(capsys, tmp_path):
    code = main(["train", *SHAPE, "--seq-len", "12", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "9 image tokens + --seq-len 12 = 21 is not divisible by --tp 2" in err, err
    assert "refuses rather than pads" in err and "--seq-len 13 would fit" in err, err


def test_the_whole_sequence_decides_not_the_caption_alone(tmp_path):
    """An odd caption is accepted when image tokens + caption divide by tp."""
    from stp.train.run.config import ModelShape, TrainJob, VisionShape
    from stp.train.run.job import check

    job = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=13),
                   vision=VisionShape(image_size=12, patch=2, vision_layers=2, vision_hidden=8),
                   pp=2, tp=2, microbatches=4, microbatch_size=1, steps=1,
                   sequence_parallel=True, out=str(tmp_path / "run"))
    run = check(job)
    assert run.config.seq_len(13) == 22


@pytest.mark.slow
def test_stp_train_arch_mllm_sequence_parallel_matches_one_process(tmp_path):
    """The flag end to end: `stp train` losses equal the reference's (AdamW, float64)."""
    import json
    import os
    import subprocess
    import sys

    from stp.train.families.mllm import mllm_batches
    from stp.train.run.config import ModelShape, TrainJob, VisionShape
    from stp.train.run.job import model_config
    from stp.train.step.lr import adamw

    job = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=13),
                   vision=VisionShape(image_size=12, patch=2, vision_layers=2, vision_hidden=8),
                   microbatches=4, microbatch_size=1, steps=2, dtype="float64")
    cfg = model_config(job)
    ref = build_mllm_reference(cfg, torch.float64)
    opt, batches, want = adamw(job.lr)(list(ref.parameters())), mllm_batches(job, cfg), []
    for step in range(2):
        opt.zero_grad()
        loss = ref.loss(*batches.batch(step))
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    argv = [*SHAPE, "--seq-len", "13", "--steps", "2", "--dtype", "float64", "--schedule",
            "stp", "--json", "--out", str(tmp_path / "run")]
    got = subprocess.run([sys.executable, "-m", "stp.cli.main", "train", *argv],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert got.returncode == 0, got.stderr[-3000:]
    losses = [r["loss"] for r in map(json.loads, got.stdout.splitlines()) if "loss" in r]
    assert len(losses) == 2
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True)) <= 1e-9, (
        losses, want)
