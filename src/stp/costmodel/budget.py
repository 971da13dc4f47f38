"""Byte budgets: `--memory-budget SIZE` read, and an estimate judged against one.

A size is plain bytes (`85899345920`) or a number with a unit: decimal
`KB`, `MB`, `GB`, `TB` (powers of 1000, as GPU datasheets count) or binary
`KiB`, `MiB`, `GiB`, `TiB` (powers of 1024, as nvidia-smi and allocators
count); `80GB` is 80e9 bytes, `80GiB` 85899345920.
"""

from __future__ import annotations

import math
import re

from stp.costmodel.memory import MemoryEstimate, format_bytes

__all__ = ["MAX_BUDGET", "parse_size", "over_budget"]

MAX_BUDGET = 1 << 60
"""Largest budget accepted (an exbibyte): far past any device."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """`80GB` -> 80000000000; ValueError (one line) for anything else."""
    shown = text[:40]
    match = _SIZE.fullmatch(text) if text.isascii() else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{shown!r} is not a size: give bytes or a number with KB, MB, GB, "
                         "TB, KiB, MiB, GiB or TiB (80GB, 80GiB)")
    value = float(match.group(1)) * _UNITS[unit]
    if not (math.isfinite(value) and 1 <= value <= MAX_BUDGET):
        raise ValueError(f"{shown!r}: a size is 1 byte to {MAX_BUDGET} bytes")
    return int(value)


def over_budget(est: MemoryEstimate, budget: float) -> str | None:
    """One line naming the rank, its total and its largest category when the
    peak rank exceeds `budget` bytes; None when every rank fits."""
    peak = est.peak
    if peak.total <= budget:
        return None
    big = peak.largest
    return (f"rank {peak.rank} needs {format_bytes(peak.total)} > budget "
            f"{format_bytes(budget)}; largest: {big} {format_bytes(getattr(peak, big))}")
