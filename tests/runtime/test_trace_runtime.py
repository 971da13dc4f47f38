"""Measured traces and braided execution on a real pp=2 x tp=2 gloo mesh (one spawn).

* emulated stages, schedule stp (braided blocks): the gathered trace holds one
  compute span per unit of every pass of every rank, one tp span per F / B
  unit, every send and receive of the lowered program; events nest on every
  lane (Perfetto drops overlapping ones); some sends waited for a held
  all-reduce (the block tails of stp.runtime.braid);
* the real model: braided and unbraided runs give the same gradients.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist

from stp.models import ModelConfig
from stp.models.emulated import EmulatedStage, UnitTimes
from stp.runtime.executor import Executor
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.runtime.trace import Recorder, gather_spans, lane_layout, write_trace
from stp.schedule.ir import Kind, passes_of
from stp.schedule.lower import Comm, lower
from stp.schedule.registry import make as make_schedule
from stp.sim.result import Span
from stp.train.step.trainer import Trainer

LAYERS, SHAPE = 2, (2, 8, 16)
CONFIG = ModelConfig(vocab_size=32, hidden=32, num_layers=8, num_heads=4, num_kv_heads=2,
                     ffn_hidden=64, max_seq_len=16, seed=3)


def _worker(rank: int, world: int, out_dir: str) -> dict:
    mesh = Mesh.from_world(ParallelDims(pp=2, tp=2), timeout=60)
    sch = make_schedule("stp", 2, 6)
    pp = mesh.coord.pp
    stages = {s: EmulatedStage(s, sch.num_stages, layers=LAYERS, hidden=SHAPE[-1],
                               times=UnitTimes(5e-4, 5e-4, 3e-4), tp_group=mesh.tp_group,
                               tp_size=2)
              for s in sch.stages_of(pp)}
    p2p = P2P(mesh.pp_group, mesh.ranks["pp"], sch.num_stages, timeout=60, where=f"r{rank}")
    rec = Recorder(rank, [sch.chunk_of(s) for s in range(sch.num_stages)])
    ex = Executor(lower(sch), pp, stages, p2p, boundary_shape=SHAPE, dtype=torch.float32,
                  recorder=rec)
    ids = torch.zeros(SHAPE[:2], dtype=torch.long)
    for _ in range(2):  # the recorder keeps the last run
        ex.run([ids] * 6, [ids] * 6)
    spans = gather_spans(rec)
    out: dict = {"deferred": ex.sends_deferred, "launched": ex.runner.stats.launched}
    if rank == 0:
        path = Path(out_dir) / "stp.json"
        write_trace(path, spans, sch, {r: r // 2 for r in range(4)}, {"test": True})
        out["spans"] = spans
    # the real model: braided and unbraided give the same gradients
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1))
    grads = {}
    for braid in (True, False):
        tr = Trainer(CONFIG, lambda ps: torch.optim.SGD(ps, lr=0.1), "stp", mesh=mesh,
                     microbatches=4, dtype=torch.float64, timeout=60, braid=braid)
        tr.step((tokens[:, :-1], tokens[:, 1:]))
        grads[braid] = tr.full_state_dict(grads=True)
    if rank == 0:
        out["grad_diff"] = max(float((grads[True][n] - g).abs().max() / g.abs().max())
                               for n, g in grads[False].items())
    dist.barrier()
    return out


@pytest.mark.slow
def test_trace_of_a_braided_pp2_tp2_run(tmp_path: Path) -> None:
    res = run_dist(_worker, 4, str(tmp_path), timeout=180)
    assert res[0]["grad_diff"] <= 1e-12
    assert all(r["deferred"] > 0 for r in res), [r["deferred"] for r in res]
    sch = make_schedule("stp", 2, 6)
    lowered = lower(sch)
    spans: list[Span] = res[0]["spans"]
    by = collections.defaultdict(list)
    for s in spans:
        by[(s.rank, s.lane)].append(s)
    units = 2 * LAYERS
    for rank in range(4):
        pp = rank // 2
        passes = [p for a in sch.actions[pp] for p in passes_of(a)]
        want = collections.Counter()
        for p in passes:
            for k in ("F", "B", "W"):
                if k == "F" and p.kind is Kind.F or k == "B" and p.kind in (Kind.B, Kind.BW) \
                        or k == "W" and p.kind in (Kind.W, Kind.BW):
                    want[(str(p), k)] += units
        got = collections.Counter((s.name, s.kind) for s in by[(rank, "compute")])
        assert got == want, rank
        n_ar = sum(v for (_, k), v in want.items() if k != "W")
        assert len(by[(rank, "tp")]) == n_ar == res[rank]["launched"] // 2
        comms = [a for a in lowered.actions[pp] if isinstance(a, Comm)]
        assert sorted(s.name for s in by[(rank, "send")]) == sorted(str(c) for c in comms)
        for s in spans:
            assert 0 <= s.start <= s.end
    doc = json.loads((tmp_path / "stp.json").read_text())
    assert doc["otherData"]["source"].startswith("stp runtime") and doc["otherData"]["test"]
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    _assert_nested(events)


def _assert_nested(events: list[dict]) -> None:
    lanes = collections.defaultdict(list)
    for e in events:
        lanes[(e["pid"], e["tid"])].append(e)
    for key, es in lanes.items():
        ends: list[float] = []
        for e in sorted(es, key=lambda e: (e["ts"], -e["dur"])):
            while ends and ends[-1] <= e["ts"] + 1e-6:  # microseconds, rounded to 1e-3
                ends.pop()
            assert not ends or e["ts"] + e["dur"] <= ends[-1] + 1e-3, (key, e)
            ends.append(e["ts"] + e["dur"])


def test_lane_layout_nests_overlapping_spans() -> None:
    def sp(a: float, b: float) -> Span:
        return Span(0, "send", a, b, "x", "SEND", 0, 0, 0)

    out = lane_layout([sp(0, 10), sp(2, 5), sp(4, 8), sp(9, 12), sp(3, 4)])
    events = [{"pid": 0, "tid": 2, "ts": s.start, "dur": s.end - s.start} for s in out]
    _assert_nested(events)
    assert sorted((s.start, s.end) for s in out) == [(0, 10), (2, 5), (3, 4), (5, 8), (10, 12)]
