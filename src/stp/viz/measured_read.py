"""A measured trace read back: the file `stp train --trace` wrote (stp.runtime.trace,
in stp.sim.trace_format's Chrome / Perfetto shape) as `Span`s, for `stp draw --measured`.

A trace is a file a user hands stp, so every field is checked as it is read:
one ValueError naming the file, the event and what was expected, never a
traceback; the file is read up to 256 MiB and at most 500,000 spans, ranks
below 4096. Events of other categories and the metadata and counter events
are skipped; the compute, tp, send and dp lanes and the action events are kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stp.files import read_json
from stp.sim.result import Span

__all__ = ["MeasuredTrace", "read_measured", "load_measured_trace", "MAX_SPANS"]

MAX_TRACE_BYTES = 256 << 20
MAX_SPANS = 500_000
MAX_RANKS = 4096
_KINDS = {"compute": ("F", "B", "W"), "tp": ("AR", "RS", "AG", "RS+AG", "A2A"),
          "send": ("SEND", "RECV"), "dp": ("DP-AR", "DP-RS", "DP-AG")}
"""The span kinds of each lane stp.runtime.trace writes."""


@dataclass(frozen=True)
class MeasuredTrace:
    spans: tuple[Span, ...]
    """Compute, tp, send and dp spans; times in milliseconds from the trace's zero."""
    actions: Mapping[tuple[int, int], str]
    """(rank, action index) -> the action's name (`7F3`, `(7F1;7I0)OVERLAP_F_B`)."""
    schedule: str
    chunks: int


class _Bad(ValueError):
    pass


def _int(a: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = a.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise _Bad(f"{key} {v!r} is not an integer in [{lo}, {hi})")
    return v


def _num(e: Mapping[str, Any], key: str) -> float:
    v = e.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or not 0 <= v <= 1e15:
        raise _Bad(f"{key} {v!r} is not a finite number of microseconds >= 0")
    return float(v)


def _name(e: Mapping[str, Any]) -> str:
    v = e.get("name")
    if not isinstance(v, str) or not 0 < len(v) <= 256:
        raise _Bad(f"name {str(v)[:40]!r} is not a string of 1 to 256 characters")
    return v


def _span(e: Mapping[str, Any], lane: str) -> Span:
    a = e.get("args")
    if not isinstance(a, Mapping):
        raise _Bad("args is not an object")
    kind = a.get("kind")
    if kind not in _KINDS[lane]:
        raise _Bad(f"kind {str(kind)[:20]!r} is not one of {', '.join(_KINDS[lane])}")
    start = _num(e, "ts") / 1e3
    unit = a.get("unit")
    if unit is not None:
        unit = _int(a, "unit", 0, 1 << 20)
    braided = a.get("braided", False)
    return Span(_int(e, "pid", 0, MAX_RANKS), lane, start, start + _num(e, "dur") / 1e3,
                _name(e), str(kind), _int(a, "stage", 0, 1 << 20), _int(a, "mb", 0, 1 << 20),
                _int(a, "chunk", 0, 1024, 0), unit, _int(a, "action_index", -1, 1 << 30, -1),
                braided is True)


def read_measured(doc: object, where: str = "the trace") -> MeasuredTrace:
    """The spans and action names of a measured trace document (module doc)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{where}: not a trace (no traceEvents list); give the file "
                         "`stp train --trace` wrote")
    other = doc.get("otherData")
    if not isinstance(other, Mapping) or "measured" not in str(other.get("source", ""))[:100]:
        raise ValueError(f"{where}: not a measured trace (otherData.source is not the stp "
                         "runtime's); give the file `stp train --trace` wrote (a simulated "
                         "timeline is drawn from its schedule: stp draw --schedule ...)")
    spans: list[Span] = []
    actions: dict[tuple[int, int], str] = {}
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, Mapping) or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        try:
            if cat in _KINDS:
                spans.append(_span(e, str(cat)))
            elif cat == "action":
                a = e.get("args")
                if not isinstance(a, Mapping):
                    raise _Bad("args is not an object")
                key = (_int(e, "pid", 0, MAX_RANKS), _int(a, "action_index", 0, 1 << 30))
                actions[key] = _name(e)
        except _Bad as bad:
            raise ValueError(f"{where}: event {i} ({str(cat)[:20]}): {bad}; give the file "
                             "`stp train --trace` wrote") from None
        if len(spans) > MAX_SPANS:
            raise ValueError(f"{where}: more than {MAX_SPANS} spans; draw a shorter run "
                             "(fewer microbatches or layers)")
    if not any(s.lane == "compute" for s in spans):
        raise ValueError(f"{where}: no compute spans to draw")
    chunks = other.get("chunks", 1)
    chunks = chunks if isinstance(chunks, int) and not isinstance(chunks, bool) and \
        1 <= chunks <= 1024 else 1
    name = other.get("schedule")
    return MeasuredTrace(tuple(spans), actions, name[:80] if isinstance(name, str) else "?",
                         chunks)


def load_measured_trace(path: str | Path) -> MeasuredTrace:
    """`read_measured` of the file at `path` (ValueError naming it)."""
    return read_measured(read_json(path, MAX_TRACE_BYTES), repr(str(path)))
