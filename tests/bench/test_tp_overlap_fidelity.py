"""`stp bench fidelity --sequence-parallel --tp-overlap-chunks K`: the emulated
chunked stage issues K pieces of every collective of a unit, and the mode's JSON
pairs each configuration's prediction with its measurement. No figure is checked
against the clock (a benchmark, not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUNTIME_TESTS = str(Path(__file__).resolve().parents[1] / "runtime")
if RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, RUNTIME_TESTS)

from _dist import run_dist  # noqa: E402

from stp.cli.main import main  # noqa: E402

B, S, H = 2, 16, 8


def _count_pieces(rank: int, world: int, chunk_counts: tuple[int, ...]) -> list[dict]:
    """`_count_one` for each K, in one world (spawning one costs more than the test)."""
    return [_count_one(rank, k) for k in chunk_counts]


def _count_one(rank: int, chunks: int) -> dict[str, object]:
    """One F, B and W unit of a non-first stage (its first unit gathers) at tp=2,
    counting the SequenceParallel calls and their sizes."""
    import torch.distributed as dist

    from stp.bench.emulated_chunked import EmulatedChunkedStage
    from stp.models.emulated import UnitTimes

    stage = EmulatedChunkedStage(1, 2, layers=1, hidden=H, times=UnitTimes(1e-4, 1e-4, 1e-4),
                                 tp_group=dist.group.WORLD, tp_size=2, tp_rank=rank,
                                 chunks=chunks)
    calls: list[tuple[str, int]] = []
    seq = stage.seq
    gather, scatter = seq.launch_gather, seq.launch_scatter

    def counted(kind, fn):
        return lambda t: (calls.append((kind, t.shape[1])), fn(t))[1]

    seq.launch_gather = counted("AG", gather)  # type: ignore[method-assign]
    seq.launch_scatter = counted("RS", scatter)  # type: ignore[method-assign]
    unit, x = stage.units[0], torch.ones(B, S // 2, H)
    phases = {}
    rows, work = stage.launch_allreduce(unit.forward_partial(0, x))
    work.wait()
    phases["F"], calls[:] = list(calls), []
    rows_b, work = stage.launch_allreduce(unit.backward_partial(0, rows))
    work.wait()
    phases["B"], calls[:] = list(calls), []
    unit.weight(0)
    phases["W"] = list(calls)
    return {"phases": phases, "rows": tuple(rows.shape), "rows_b": tuple(rows_b.shape),
            "pieces": stage.pieces_launched}


def test_chunked_stage_issues_k_pieces_of_each_collective():
    counts = (2, 4)
    for chunks, res in zip(counts, run_dist(_count_pieces, 2, counts, timeout=120)[0],
                           strict=True):
        _check_pieces(chunks, res)


def _check_pieces(chunks: int, res: dict) -> None:
    piece = S // 2 // chunks  # rows of this rank's s/t in one piece
    for kind in ("F", "B"):
        calls = res["phases"][kind]
        assert [c for c in calls if c[0] == "AG"] == [("AG", piece)] * chunks, kind
        # a reduce-scatter piece splits chunk k of every rank: t pieces of rows
        assert [c for c in calls if c[0] == "RS"] == [("RS", 2 * piece)] * chunks, kind
    assert res["phases"]["W"] == [("AG", piece)] * chunks  # W gathers its input again
    assert res["rows"] == res["rows_b"] == (B, S // 2, H)  # every piece laid back in place
    assert res["pieces"] == 2 * chunks


def test_fidelity_json_pairs_predicted_and_measured():
    out = subprocess.run(
        [sys.executable, "-m", "stp.cli.main", "bench", "fidelity", "--sequence-parallel",
         "--tp-overlap-chunks", "2", "--schedules", "stp", "-m", "4", "--layers", "1",
         "--hidden", "8", "--seq-len", "8", "--rounds", "1", "--unit-ms", "f=0.5,b=0.5,w=0.5",
         "--json"], capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.splitlines()[-1])
    assert [(r["schedule"], r["chunks"]) for r in res["rows"]] == [("stp", 0), ("stp", 2)]
    for r in res["rows"]:
        assert r["predicted"] > 0 and r["measured"] > 0 and len(r["steps"]) == 1
        assert r["ratio"] == pytest.approx(r["measured"] / r["predicted"])
        # 4 mb x 2 chunks x (F + B + W) units of 0.5 ms bound the step from below
        assert r["predicted"] >= 4 * 2 * 3 * 2 * 0.5e-3
    # one stp step, m=4: per rank 2 chunks x 2 units x (F + B) x 4 mb, K scatters each
    assert res["rows"][1]["pieces_per_step"] == 2 * 2 * 2 * 4 * 2
    assert res["chunked"]["2"]["call_s"] >= 0 and res["gather_s"] > 0
    assert "stp + in-layer K=2" in out.stdout


def test_fidelity_refuses_chunks_without_sequence_parallel(capsys):
    assert main(["bench", "fidelity", "--tp-overlap-chunks", "2"]) == 2
    assert "add --sequence-parallel" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--sequence-parallel", "--tp-overlap-chunks", "3"]) == 2
    assert "must divide into 3 chunks" in capsys.readouterr().err
