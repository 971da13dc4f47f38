"""Sequence parallelism with more than one sequence per microbatch equals the
single-process reference.

Guards against a wrong block order in sequence parallelism's collectives
(stp.models.tp.sequence): the reduce-scatter must hand rank r rows
[r s/t, (r+1) s/t) of EVERY sequence of the microbatch, and the all-gather must
put each rank's rows back into every sequence. Taking the [b, s, h] partial sum
as b*t blocks in batch-major order (reshape without the transpose), or viewing
the gathered blocks batch-major, is the same at b = 1 -- where every other
sequence-parallel parity test runs -- and mixes rows of different sequences at
b >= 2. float64, pp1 x tp2, 3 sequences per microbatch, one V schedule braided
(stp: both its stages on the one pipeline rank) and one classic unbraided
(1f1b): losses, first-step gradients and parameters after two SGD steps within
1e-9 of the reference (the criterion of test_sequence_parallel_runtime.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import run_dist
from _parity import compare_with_reference, random_batch, sgd, two_steps

from stp.models import ModelConfig
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.step.trainer import Trainer

CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
SEQ, PER_MICROBATCH, M = 8, 3, 2
"""Sequence length (4 rows per TP rank), sequences per microbatch, microbatches."""
TOL = 1e-9
CASES = [("stp", True), ("1f1b", False)]
"""(schedule, braided): the braided one launches its all-gathers early
(stp.runtime.braid's advance), the unbraided one at each unit's start."""


def _worker(rank: int, world: int) -> dict:
    mesh = Mesh.from_world(ParallelDims(1, 2, 1), timeout=60)
    out = {}
    for name, braid in CASES:
        sch = registry.make(name, 1, M)
        trainer = Trainer(CONFIG, sgd, sch, mesh=mesh, dtype=torch.float64, timeout=60,
                          sequence_parallel=True, braid=braid)
        batches = [random_batch(CONFIG.vocab_size, PER_MICROBATCH * M, SEQ, s)
                   for s in range(2)]
        losses, grads, params = two_steps(trainer, batches)
        every: list = [None] * world
        dist.all_gather_object(every, losses)
        if rank == 0:
            diffs = compare_with_reference(CONFIG, torch.float64, batches, losses, grads,
                                           params)
            out[name] = {"same": all(e == losses for e in every), **diffs}
    return out


def test_three_sequences_per_microbatch_equal_the_reference() -> None:
    """Bug guarded: the reduce-scatter's or the all-gather's blocks taken batch-major
    instead of rank-major (each rank then holds rows of the wrong sequences)."""
    res = run_dist(_worker, 2, timeout=300)[0]
    assert set(res) == {name for name, _ in CASES}
    bad = []
    for name, r in sorted(res.items()):
        print(name, {k: f"{r[k]:.1e}" for k in ("loss", "grad", "param")})
        if not r["same"]:
            bad.append(f"{name}: the TP ranks returned different losses")
        bad += [f"{name}: {k} differs from the reference by {r[k]:.3g} (tolerance {TOL:g})"
                for k in ("loss", "grad", "param") if not r[k] <= TOL]
    assert not bad, "\n".join(bad)
