"""Parity: the distributed Trainer equals a single-process reference.

For every schedule and each mesh (pp, tp, dp) in {(2,1,1), (2,2,1), (4,1,1),
(1,2,1), (2,1,2)}: the step's loss, every parameter's gradient after the
first step, and every parameter after two optimizer steps (SGD with
momentum) equal `stp.models.build_reference` run on the whole global batch.

Criterion per tensor: max |dist - ref| <= TOL * max |ref|, with
  float64: TOL = 1e-9 (the issue's bar; observed ~1e-15);
  float32: TOL = 1e-4 for gradients and parameters, 1e-5 for the loss
           (observed about 1e-6: summation order differs between the
           sharded / pipelined run and the reference, and a float32 TP
           all-reduce of partial sums rounds differently).

One spawn per mesh; every applicable schedule runs inside that process group.

Broken variant (default suite, one 4-process spawn, one schedule): bugs
planted in the runtime must fail the same comparison at the same
tolerances: DP averaging removed (pp2-tp1-dp2, float64), and a TP
all-reduce that rounds its partial sums to a 16-bit format (pp2-tp2-dp1,
float32: a real bug whose gradient error, ~3e-3, a tolerance of 1e-2 would
miss), beside the correct runs on both meshes, which pass (so the default
suite checks DP and float32 TP parity on the code as it is, too).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist
from _parity import compare_with_reference, random_batch, sgd, two_steps

import stp.models.decoder.stage
from stp.models import ModelConfig
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.schedule.registry import make as make_schedule
from stp.train.step.grad_sync import GradSync
from stp.train.step.trainer import Trainer

MESHES = [(2, 1, 1), (2, 2, 1), (4, 1, 1), (1, 2, 1), (2, 1, 2)]
CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
SEQ, MBS = 8, 1
TOL = {"float64": {"loss": 1e-9, "grad": 1e-9, "param": 1e-9},
       "float32": {"loss": 1e-5, "grad": 1e-4, "param": 1e-4}}
FLOAT32_MESH = (2, 2, 1)


def _batch(rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(CONFIG.vocab_size, rows, SEQ, step)


def applicable(pp: int) -> list[str]:
    return [n for n in registry.names() if pp >= registry.get(n).min_ranks]


def _mesh_worker(rank: int, world: int, pp: int, tp: int, dp: int, dtypes: list[str]) -> dict:
    mesh = Mesh.from_world(ParallelDims(pp, tp, dp), timeout=60)
    out = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for name in applicable(pp):
            sch = make_schedule(name, pp)
            m = sch.num_microbatches
            trainer = Trainer(CONFIG, sgd, sch, mesh=mesh, dtype=dtype, timeout=60)
            batches = [_batch(dp * m * MBS, step) for step in range(2)]
            losses, grads, params = two_steps(trainer, batches)
            every = [None] * world
            dist.all_gather_object(every, losses)
            if rank != 0:
                continue
            diffs = compare_with_reference(CONFIG, dtype, batches, losses, grads, params)
            out[(dtype_name, name)] = {
                "m": m,
                "same_on_every_rank": all(e == losses for e in every),
                **diffs,
            }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "pp{}-tp{}-dp{}".format(*m))
def test_every_schedule_matches_the_reference(mesh: tuple[int, int, int]) -> None:
    pp, tp, dp = mesh
    dtypes = ["float64", "float32"] if mesh == FLOAT32_MESH else ["float64"]
    res = run_dist(_mesh_worker, pp * tp * dp, pp, tp, dp, dtypes, timeout=240)[0]
    expected = {(d, n) for d in dtypes for n in applicable(pp)}
    assert set(res) == expected
    bad = []
    for (dtype_name, name), r in sorted(res.items()):
        tol = TOL[dtype_name]
        print(f"{mesh} {dtype_name} {name:17s} m={r['m']:2d} loss {r['loss']:.1e} "
              f"grad {r['grad']:.1e} param {r['param']:.1e}")
        if not r["same_on_every_rank"]:
            bad.append(f"{dtype_name} {name}: ranks returned different losses")
        bad += [
            f"{dtype_name} {name}: {k} differs by {r[k]:.3g} (tolerance {tol[k]:g})"
            for k in ("loss", "grad", "param") if not r[k] <= tol[k]
        ]
    assert not bad, "\n".join(bad)


def _rounding(fmt: torch.dtype) -> list[tuple[object, str, object]]:
    """The stages' TP all-reduces (synchronous and launched) summing partial sums
    first rounded to `fmt`."""
    make, launch = stp.models.decoder.stage.make_allreduce, stp.models.decoder.stage.launch_sum

    def make_rounding(group, tp_size):
        inner = make(group, tp_size)
        return lambda t: inner(t.to(fmt).to(t.dtype))

    def launch_rounding(tensor, group):
        tensor.copy_(tensor.to(fmt))  # in place: the launch reduces this very tensor
        return launch(tensor, group)

    return [(stp.models.decoder.stage, "make_allreduce", make_rounding),
            (stp.models.decoder.stage, "launch_sum", launch_rounding)]


def _skip_dp_average(self, *args, **kw) -> list:
    return []  # nothing launched, nothing averaged


BROKEN = {
    "no DP averaging": ((2, 1, 2), "float64", [(GradSync, "average_dp", _skip_dp_average)]),
    "TP all-reduce of float16 partial sums": ((2, 2, 1), "float32", _rounding(torch.float16)),
    "none (float32)": ((2, 2, 1), "float32", []),
    "none (pp2-tp1-dp2)": ((2, 1, 2), "float64", []),
}
"""Planted bug: (mesh, dtype, [(owner, attribute, replacement)])."""
BROKEN_SCHEDULE, BROKEN_M = "1f1b", 2


def _broken_worker(rank: int, world: int) -> dict:
    out, meshes = {}, {}
    for bug, (dims, dtype_name, patches) in BROKEN.items():
        if dims not in meshes:
            meshes[dims] = Mesh.from_world(ParallelDims(*dims), timeout=60)
        mesh = meshes[dims]
        kept = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
        for owner, attr, planted in patches:
            setattr(owner, attr, planted)
        try:
            dtype = getattr(torch, dtype_name)
            sch = make_schedule(BROKEN_SCHEDULE, dims[0], BROKEN_M)
            trainer = Trainer(CONFIG, sgd, sch, mesh=mesh, dtype=dtype, timeout=60)
            batches = [_batch(dims[2] * sch.num_microbatches * MBS, step) for step in range(2)]
            losses, grads, params = two_steps(trainer, batches)
        finally:
            for owner, attr, value in kept:
                setattr(owner, attr, value)
        if rank == 0:
            out[bug] = (dtype_name, compare_with_reference(CONFIG, dtype, batches, losses,
                                                           grads, params))
    return out


def test_planted_bugs_fail_the_comparison() -> None:
    res = run_dist(_broken_worker, 4, timeout=240)[0]
    assert set(res) == set(BROKEN)
    for bug, (dtype_name, r) in res.items():
        tol = TOL[dtype_name]
        print(f"{bug}: loss {r['loss']:.1e} grad {r['grad']:.1e} param {r['param']:.1e}")
        caught = any(not r[k] <= tol[k] for k in ("loss", "grad", "param"))
        assert caught == bool(BROKEN[bug][2]), (bug, r, tol)
