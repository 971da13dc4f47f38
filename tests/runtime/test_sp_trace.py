"""A braided sequence-parallel run's measured trace (pp2 x tp2, the STP schedule, the
real decoder, one step): every rank's TP lane holds the collectives by name,
AR (the loss statistics, where the loss is), RS (the reduce-scatter ending each unit) and AG (the
all-gather starting one), and inside braided blocks some reduce-scatters and some
all-gathers run while the partner pass computes (braiding hides them, STP paper
arXiv 2510.27257, Fig. 3). `stp draw --measured` draws that trace with each
collective named."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from _dist import run_dist

from stp.cli.main import main
from stp.models import ModelConfig
from stp.runtime.mesh import Mesh, ParallelDims
from stp.train.trainer import Trainer
from stp.viz.measured_read import load_measured_trace

CONFIG = ModelConfig(vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     ffn_hidden=64, max_seq_len=16, seed=3)


def _worker(rank: int, world: int, path: str) -> None:
    mesh = Mesh.from_world(ParallelDims(2, 2, 1), timeout=60)
    trainer = Trainer(CONFIG, lambda ps: torch.optim.SGD(ps, lr=0.1), "stp", mesh=mesh,
                      microbatches=4, timeout=60, sequence_parallel=True, trace=True)
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    trainer.step((tokens[:, :-1], tokens[:, 1:]))
    trainer.write_trace(path, {"test": True})


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


def test_braided_sp_trace_names_rs_and_ag_and_hides_them(tmp_path: Path, capsys) -> None:
    path = tmp_path / "sp.json"
    run_dist(_worker, 4, str(path), timeout=180)
    trace = load_measured_trace(path)
    for rank in range(4):
        kinds = {s.kind for s in trace.spans if s.rank == rank and s.lane == "tp"}
        # the V places the loss (its statistics' all-reduce) on pipeline rank 0
        assert kinds == ({"AR", "RS", "AG"} if rank < 2 else {"RS", "AG"}), (rank, kinds)
        assert _overlaps(trace.spans, rank, "RS") > 0, rank
        assert _overlaps(trace.spans, rank, "AG") > 0, rank
    svg = tmp_path / "sp.svg"
    assert main(["draw", "--measured", str(path), "--out", str(svg)]) == 0
    text = svg.read_text()
    for needle in ("reduce-scatter (RS)", "all-gather (AG)", "TP all-reduce", "RS of 0F",
                   "AG of 0F", "under compute", "braided block"):
        assert needle in text, needle
