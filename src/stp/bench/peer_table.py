"""The peer benchmark's figures (stp.bench.peer.run_peer) as Markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from stp.bench.peer import PeerSpec

__all__ = ["format_table", "format_tables", "failed_setting"]


def format_table(result: dict[str, Any]) -> str:
    """The figures of one run (one setting) as Markdown: see `format_tables`."""
    return format_tables([result])


def failed_setting(spec: PeerSpec, error: str) -> dict[str, Any]:
    """A result standing for a setting whose whole run failed: one row per schedule
    saying why, so the table still shows it."""
    rows = [{"schedule": name, "times": {}, "cpu": {}, "first_s": {}, "first_loss": {},
             "missing": {"stp": error, "torch": error}} for name in spec.schedules]
    return {"spec": spec, "rows": rows}


def format_tables(results: list[dict[str, Any]]) -> str:
    """Runs of one model size at several settings (tp1 eager, tp2 compiled, ...) as
    Markdown: per setting and schedule, each side's median step time (ms, slowest
    rank), stp / side min / median / max over rounds, the first step's wall time
    (compilation included) and the first loss's relative difference from stp's;
    a side that did not run says why instead. Then per side and rank the median
    CPU ms and page faults per step and the peak resident growth in a step (MiB)."""
    spec: PeerSpec = results[0]["spec"]
    others = _others(results)
    lines = [f"pp={spec.pp}, {spec.model.num_layers} layers, hidden {spec.model.hidden}, "
             f"seq {spec.seq_len}, microbatch size {spec.microbatch_size}, "
             f"m={spec.microbatches}, {spec.dtype}, {spec.pairs} rounds; tp2 runs pp x tp "
             f"= {spec.pp * 2} processes", "",
             "| setting | schedule | stp ms | " + " | ".join(
                 f"{k} ms | stp/{k} min / med / max" for k in others)
             + " | first step s (" + ", ".join(["stp", *others]) + ") | first loss vs stp |",
             "|---" * (5 + 2 * len(others)) + "|"]
    for result in results:
        label = result["spec"].label
        for row in result["rows"]:
            cells = [_median_ms(row, "stp")]
            for k in others:
                ok = k in row["times"] and "stp" in row["times"]
                cells += [_median_ms(row, k), _spread(row[f"ratio_{k}"]) if ok else "-"]
            firsts = ", ".join(f"{row['first_s'][k]:.1f}" if k in row["first_s"] else "-"
                               for k in ["stp", *others])
            lines.append(f"| {label} | {row['schedule']} | " + " | ".join(cells)
                         + f" | {firsts} | {_loss_diff(row)} |")
    lines += ["", "| setting | schedule | side | CPU ms per rank | CPU stp/side per rank "
              "| page faults per rank | peak MiB per rank |", "|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["rows"]:
            lines += _cpu_lines(result["spec"].label, row)
    return "\n".join(lines)


def _others(results: list[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for result in results:
        for row in result["rows"]:
            for k in [*row["times"], *row.get("missing", {})]:
                if k != "stp" and k not in seen:
                    seen.append(k)
    return seen


def _median_ms(row: dict[str, Any], side: str) -> str:
    if side in row["times"]:
        return f"{1e3 * statistics.median(row['times'][side]):.1f}"
    reason = row.get("missing", {}).get(side)
    return f"not run: {reason}" if reason else "-"


def _loss_diff(row: dict[str, Any]) -> str:
    losses = row["first_loss"]
    if "stp" not in losses or len(losses) < 2:
        return "-"
    ref = losses["stp"]
    worst = max(abs(v - ref) for k, v in losses.items() if k != "stp")
    return f"{worst / abs(ref):.1e}"


def _cpu_lines(label: str, row: dict[str, Any]) -> list[str]:
    cpu = {k: _per_rank(v, 0) for k, v in row["cpu"].items()}
    lines = []
    for side in row["cpu"]:
        ratio = "-" if side == "stp" or "stp" not in cpu else _join(
            (a / b for a, b in zip(cpu["stp"], cpu[side], strict=True)), "{:.2f}")
        peaks = (row.get("peak_mib") or {}).get(side) or []
        lines.append(f"| {label} | {row['schedule']} | {side} | "
                     f"{_join(1e3 * c for c in cpu[side])} | {ratio} | "
                     f"{_join(_per_rank(row['cpu'][side], 1))} | "
                     f"{', '.join('?' if v is None else f'{v:.0f}' for v in peaks) or '-'} |")
    return lines


def _per_rank(rounds: list[list[tuple[float, int]]], field: int) -> list[float]:
    return [statistics.median(r[k][field] for r in rounds) for k in range(len(rounds[0]))]


def _join(values: Any, fmt: str = "{:.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"
