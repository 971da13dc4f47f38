"""The peer benchmark's figures (stp.bench.peer.run_peer) as Markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from stp.bench.peer import PeerSpec

__all__ = ["format_table"]


def format_table(result: dict[str, Any]) -> str:
    """The figures of one run as Markdown: per schedule, each side's median step time
    (ms, slowest rank) and stp / side min / median / max over rounds; then per side
    and rank the median CPU ms and page faults per step and the peak resident
    growth in a step (MiB)."""
    spec: PeerSpec = result["spec"]
    rows = result["rows"]
    others = [k for k in rows[0]["times"] if k != "stp"]
    lines = [f"pp={spec.pp} tp=1, {spec.model.num_layers} layers, hidden {spec.model.hidden}, "
             f"seq "
             f"{spec.seq_len}, microbatch size {spec.microbatch_size}, m={spec.microbatches}, "
             f"{spec.dtype}, {spec.pairs} rounds", "",
             "| schedule | stp ms | " + " | ".join(f"{k} ms | stp/{k} min / med / max"
                                                   for k in others) + " |",
             "|---" * (2 + 2 * len(others)) + "|"]
    for row in rows:
        med = {k: f"{1e3 * statistics.median(v):.1f}" for k, v in row["times"].items()}
        ratios = [f"{med[k]} | {_spread(row[f'ratio_{k}'])}" for k in others]
        lines.append(f"| {row['schedule']} | {med['stp']} | " + " | ".join(ratios) + " |")
    lines += ["", "| schedule | side | CPU ms per rank | CPU stp/side per rank "
              "| page faults per rank | peak MiB per rank |", "|---|---|---|---|---|---|"]
    for row in rows:
        cpu = {k: _per_rank(v, 0) for k, v in row["cpu"].items()}
        for side in row["cpu"]:
            ratio = "-" if side == "stp" else _join(
                (a / b for a, b in zip(cpu["stp"], cpu[side], strict=True)), "{:.2f}")
            peaks = (row.get("peak_mib") or {}).get(side) or []
            lines.append(f"| {row['schedule']} | {side} | {_join(1e3 * c for c in cpu[side])} "
                         f"| {ratio} | {_join(_per_rank(row['cpu'][side], 1))} | "
                         f"{', '.join('?' if v is None else f'{v:.0f}' for v in peaks) or '-'} |")
    return "\n".join(lines)


def _per_rank(rounds: list[list[tuple[float, int]]], field: int) -> list[float]:
    return [statistics.median(r[k][field] for r in rounds) for k in range(len(rounds[0]))]


def _join(values: Any, fmt: str = "{:.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"
