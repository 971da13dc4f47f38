"""The report of `stp bench fidelity --sequence-parallel [--tp-overlap-chunks K]`:
each configuration's measured median step (stp.bench.fidelity_inlayer) beside
the simulator's prediction for the same measured costs
(stp.sim.predict.predict_emulated), and their ratio."""

from __future__ import annotations

import statistics
from typing import Any

from stp.models.emulated import UnitTimes
from stp.schedule.registry import make as make_schedule
from stp.sim.predict import predict_emulated

__all__ = ["predict_rows", "format_report", "label"]


def label(schedule: str, chunks: int) -> str:
    """`zb-v + in-layer K=4`, or the schedule's name without chunks."""
    return f"{schedule} + in-layer K={chunks}" if chunks else schedule


def predict_rows(res: dict[str, Any], unit: UnitTimes, *, layers: int, microbatches: int,
                 braid: bool) -> list[dict[str, Any]]:
    """One row per measured configuration: predicted and measured seconds, their ratio."""
    rows = []
    for r in res["rows"]:
        sch, k = make_schedule(r["schedule"], 2, microbatches), r["chunks"]
        piece = res["chunked"].get(str(k), {})
        launch = piece.get("launch_chunk_s", 0.0) if k > 1 else res["launch_whole_s"]
        common = {"layers": layers, "gather_s": res["gather_s"], "scatter_s": res["scatter_s"],
                  "comm_s": res["p2p_s"], "launch_s": launch, "chunks": k,
                  "call_s": piece.get("call_s", 0.0), "braid": braid}
        nominal = predict_emulated(sch, (unit.f, unit.b, unit.w), **common)
        sim = predict_emulated(sch, (unit.f, unit.b, unit.w), efficiency=_efficiency(piece, k),
                               **common) if k > 1 else nominal
        rows.append({"schedule": r["schedule"], "chunks": k, "label": label(r["schedule"], k),
                     "predicted": sim.makespan, "predicted_nominal": nominal.makespan,
                     "efficiency": _efficiency(piece, k) if k > 1 else 1.0,
                     "measured": r["measured"],
                     "ratio": r["measured"] / sim.makespan, "steps": r["steps"],
                     "spread": (max(r["steps"]) - min(r["steps"])) / r["measured"],
                     "pieces_per_step": r["pieces_per_step"]})
    return rows


def _efficiency(piece: dict[str, float], chunks: int) -> float:
    """A unit's measured time over K times one slice's (stp.sim.inlayer's e), at most 1."""
    return min(1.0, piece["hold_s"] / (chunks * piece["slice_s"]))


def format_report(res: dict[str, Any], rows: list[dict[str, Any]], unit: UnitTimes, *,
                  layers: int, microbatches: int, shape: tuple[int, int, int],
                  braid: bool) -> str:
    """The printed table (times in ms)."""
    ms = 1e3
    lines = [
        f"pp=2 x tp=2, sequence parallel, m={microbatches}, {layers} layers per chunk, units "
        f"F {unit.f * ms:g} / B {unit.b * ms:g} / W {unit.w * ms:g} ms (emulated), braid "
        f"{'on' if braid else 'off'}",
        f"measured first, microbatch {list(shape)} floats, each after an emulated unit: "
        f"all-gather {res['gather_s'] * ms:.2f} ms, reduce-scatter {res['scatter_s'] * ms:.2f} ms, "
        f"launch calls {res['launch_whole_s'] * ms:.3f} ms, point-to-point "
        f"{res['p2p_s'] * ms:.2f} ms"]
    for k, piece in sorted(res["chunked"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"  in {k} pieces: all-gather {piece['gather_chunked_s'] * ms:.2f} ms, "
                     f"reduce-scatter {piece['scatter_chunked_s'] * ms:.2f} ms; one more call "
                     f"{piece['call_s'] * ms:.3f} ms, launch calls per chunk "
                     f"{piece['launch_chunk_s'] * ms:.3f} ms; an F unit {piece['hold_s'] * ms:.2f}"
                     f" ms whole, {piece['slice_s'] * ms:.2f} ms a slice (e = "
                     f"{_efficiency(piece, int(k)):.3f})")
    lines.append(f"{'configuration':26s} {'predicted':>10s} {'measured':>10s} {'ratio':>7s} "
                 f"{'spread':>7s} {'at e = 1':>10s} {'ratio':>7s}")
    for r in rows:
        nom = r["predicted_nominal"]
        lines.append(f"{r['label']:26s} {r['predicted'] * ms:7.1f} ms {r['measured'] * ms:7.1f} ms "
                     f"{r['ratio']:7.3f} {r['spread']:7.1%} {nom * ms:7.1f} ms "
                     f"{r['measured'] / nom:7.3f}")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    lines.append(f"measured: median of {len(rows[0]['steps'])} rounds (configurations "
                 f"alternating); spread: (max - min) / median; worst |ratio - 1| "
                 f"{worst:.1%}; median {statistics.median(r['ratio'] for r in rows):.3f}")
    return "\n".join(lines)
