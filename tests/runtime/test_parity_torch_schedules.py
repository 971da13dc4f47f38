"""Parity of the schedules PyTorch ships that stp added (looped-bfs,
zb-interleaved, dualpipev with its braided F&B pairs): the distributed
Trainer equals the single-process reference in float64 to 1e-9 (loss,
first-step gradients, parameters after two SGD-momentum steps).

The default run covers pp2 x tp2 (pipeline sends, the V tip, braided
pairs with real TP all-reduces in flight); pp2, pp2 x dp2 and pp4 are
`slow` (tests/runtime/test_parity.py's slow meshes run them too, among
every schedule).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_dist
from _parity import compare_with_reference, random_batch, sgd, two_steps

from stp.models import ModelConfig
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import Block
from stp.schedule.registry import make as make_schedule
from stp.train.step.trainer import Trainer

NAMES = ("looped-bfs", "zb-interleaved", "dualpipev")
CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=8, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
SEQ, TOL = 8, 1e-9


def _worker(rank: int, world: int, pp: int, tp: int, dp: int) -> dict:
    mesh = Mesh.from_world(ParallelDims(pp, tp, dp), timeout=60)
    out = {}
    for name in NAMES:
        sch = make_schedule(name, pp)
        m = sch.num_microbatches
        trainer = Trainer(CONFIG, sgd, sch, mesh=mesh, dtype=torch.float64, timeout=60)
        batches = [random_batch(CONFIG.vocab_size, dp * m, SEQ, step) for step in range(2)]
        losses, grads, params = two_steps(trainer, batches)
        if rank == 0:
            out[name] = {
                "blocks": sum(isinstance(a, Block) for acts in sch.actions for a in acts),
                **compare_with_reference(CONFIG, torch.float64, batches, losses, grads, params),
            }
    return out


MESHES = [
    pytest.param((2, 2, 1), id="pp2-tp2"),
    pytest.param((2, 1, 1), id="pp2", marks=pytest.mark.slow),
    pytest.param((2, 1, 2), id="pp2-dp2", marks=pytest.mark.slow),
    pytest.param((4, 1, 1), id="pp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh", MESHES)
def test_new_schedules_match_the_reference(mesh):
    pp, tp, dp = mesh
    res = run_dist(_worker, pp * tp * dp, pp, tp, dp, timeout=300)[0]
    assert set(res) == set(NAMES)
    # DualPipeV runs braided pairs (m = 2p: the main step once on every rank
    # but the last, plus step 5), the others none
    assert res["dualpipev"]["blocks"] > 0
    assert res["looped-bfs"]["blocks"] == res["zb-interleaved"]["blocks"] == 0
    bad = []
    for name, r in sorted(res.items()):
        print(f"{mesh} {name:15s} loss {r['loss']:.1e} grad {r['grad']:.1e} "
              f"param {r['param']:.1e}")
        bad += [f"{name}: {k} differs by {r[k]:.3g}" for k in ("loss", "grad", "param")
                if not r[k] <= TOL]
    assert not bad, "\n".join(bad)
