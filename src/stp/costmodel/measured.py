"""Per-stage costs measured by `stp train --trace`: a runtime trace turned into
the simulator's `StageCosts`, so the simulator and the search work on the
user's own model and machine.

The trace (`stp.runtime.trace`, Chrome / Perfetto JSON in the shape of
`stp.sim.trace_format`) holds every action (one pass, or a braided block) with its
units' compute spans (kind F, B or W), every TP all-reduce on the tp lane and
every send and receive. Per global stage, averaged over the microbatches and
over the ranks that run it (TP and DP replicas):

    f, b, w     each action's wall time (its units and the runtime's work
                between them), shared among its passes and their F / B / W
                units by unit time, plus the rank's dispatch time: the mean,
                over its actions whose input was there when the previous one
                ended, of the time between the two. The simulator has no other
                place for that work (posting sends and receives, Python
                between actions, the rank waiting for a core); the mean, not
                a median, so that the step's total comes out right.
    ar, ar_b    the all-reduce lane's occupancy after F and after B units
    a2a         expert parallelism's all-to-all spans (kind A2A) of F and B
                together, halved: one pass's
    units       compute spans of one forward pass
    comm        the mean time from a remote input's producing action's end
                to the start of an action that waited for it, less the mean
                dispatch time (already in the producer's pass)
    mem_b       not in a trace: each stage keeps its share of one rank's M_B
                by its layers (the trace's `partition`, else equal)

Times are milliseconds (the trace's microseconds / 1000).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stp.files import read_json
from stp.sim.stages import StageCost, StageCosts

__all__ = ["measured_stage_costs", "load_measured"]

MAX_TRACE_BYTES = 256 << 20
_PASS = re.compile(r"^(\d+)([FIBW])(\d+)$")
_KEY = {"F": "f", "B": "b", "W": "w"}
"""Unit kind -> the cost it adds to."""
Event = Mapping[str, Any]


def _producers(name: str, num_stages: int) -> tuple[str, ...]:
    """Names of the passes whose results pass `name` waits for."""
    m = _PASS.match(name)
    if m is None:
        return ()
    s, kind, mb = int(m[1]), m[2], m[3]
    if kind == "F":
        return (f"{s - 1}F{mb}",) if s > 0 else ()
    if kind == "W":
        return (f"{s}I{mb}",)
    return (f"{s + 1}I{mb}", f"{s + 1}B{mb}") if s < num_stages - 1 else ()


def _check_doc(doc: object, where: str) -> tuple[list[Event], Mapping[str, Any]]:
    if not isinstance(doc, Mapping) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{where}: not a trace (no traceEvents list); give the file "
                         "`stp train --trace` wrote")
    other = doc.get("otherData")
    if not isinstance(other, Mapping) or "measured" not in str(other.get("source", "")):
        raise ValueError(f"{where}: not a measured trace (otherData.source is not the stp "
                         "runtime's); give the file `stp train --trace` wrote")
    return [e for e in doc["traceEvents"] if isinstance(e, Mapping) and e.get("ph") == "X"
            and isinstance(e.get("args"), Mapping)], other


class _Trace:
    """The trace's actions, units and all-reduces, indexed."""

    def __init__(self, events: list[Event]) -> None:
        self.actions: dict[int, list[Event]] = defaultdict(list)
        self.units: dict[tuple[int, int], dict[tuple[str, str], float]] = defaultdict(
            lambda: defaultdict(float))
        """(rank, action index) -> (pass name, unit kind) -> compute time."""
        self.f_units: dict[tuple[int, str], int] = defaultdict(int)
        self.ar: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.stages: set[int] = set()
        for ev in events:
            a, rank = ev["args"], int(ev["pid"])
            cat = ev.get("cat")
            if cat == "action":
                self.actions[rank].append(ev)
            elif cat == "compute" and str(a.get("kind")) in _KEY:
                kind = str(a["kind"])
                self.units[(rank, int(a["action_index"]))][(str(ev["name"]), kind)] += ev["dur"]
                self.stages.add(int(a["stage"]))
                self.f_units[(rank, str(ev["name"]))] += kind == "F"
            elif cat == "tp":
                letter = _PASS.match(str(ev["name"]))
                key = "ar" if letter is not None and letter[2] == "F" else "ar_b"
                if str(a.get("kind")) == "A2A":  # expert parallelism's, F's and B's together
                    key = "a2a"
                self.ar[(rank, int(a["stage"]))][key] += float(ev["dur"])
        for acts in self.actions.values():
            acts.sort(key=lambda e: float(e["ts"]))
        self.end = {p: float(e["ts"]) + float(e["dur"])
                    for acts in self.actions.values() for e in acts for p in e["args"]["passes"]}

    def delays(self, rank: int, num_stages: int) -> tuple[list[float], list[float]]:
        """(per action of `rank` whose input was produced when the previous
        action ended: the time between the two; per action that waited for an
        input: the time from its production to the action's start)."""
        waits, late, prev_end = [], [], None
        for ev in self.actions[rank]:
            ready = max((self.end.get(q, 0.0) for p in ev["args"]["passes"]
                         for q in _producers(p, num_stages)), default=0.0)
            start = float(ev["ts"])
            if prev_end is not None:
                if ready > prev_end:
                    late.append(max(0.0, start - ready))
                else:
                    waits.append(max(0.0, start - prev_end))
            prev_end = start + float(ev["dur"])
        return waits, late

    def dispatch(self, rank: int, num_stages: int) -> float:
        """Mean time from when an action of `rank` could start to its start."""
        waits, _ = self.delays(rank, num_stages)
        return statistics.fmean(waits) if waits else 0.0

    def latency(self, num_stages: int) -> float:
        """The send latency the simulator adds after a pass that ends with its
        rank's dispatch time (module doc)."""
        waits, late = [], []
        for rank in self.actions:
            w, lt = self.delays(rank, num_stages)
            waits += w
            late += lt
        if not late:
            return 0.0
        return max(0.0, statistics.fmean(late) - statistics.fmean(waits or [0.0]))


def _pass_times(tr: _Trace, num_stages: int) -> dict[tuple[int, int], dict[str, float]]:
    """(rank, stage) -> total f, b, w time (actions shared by unit time, plus dispatch)."""
    out: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for rank, acts in tr.actions.items():
        extra = tr.dispatch(rank, num_stages)
        for ev in acts:
            parts = tr.units.get((rank, int(ev["args"]["action_index"])), {})
            total = sum(parts.values())
            wall = float(ev["dur"]) + extra
            for (name, kind), t in parts.items():
                m = _PASS.match(name)
                if m is not None and total > 0:
                    out[(rank, int(m[1]))][_KEY[kind]] += wall * t / total
    return out


def measured_stage_costs(doc: object, where: str = "the trace") -> StageCosts:
    """The per-stage costs of a measured trace document (module doc)."""
    events, other = _check_doc(doc, where)
    tr = _Trace(events)
    n = len(tr.stages)
    if not n or sorted(tr.stages) != list(range(n)):
        raise ValueError(f"{where}: no compute spans of stages 0..S-1 found")
    m = int(other.get("microbatches") or 0)
    if m < 1:
        raise ValueError(f"{where}: otherData.microbatches is missing")
    times = _pass_times(tr, n)
    part = other.get("partition")
    counts = list(part) if isinstance(part, list) and len(part) == n else [1] * n
    chunks = max(1, n // max(1, int(other.get("pp") or 1)))
    share = n / chunks / sum(counts)  # M_B of one rank's share, per layer
    rows = []
    for s in range(n):
        ranks = sorted({r for r, st in times if st == s})
        vals = {k: statistics.fmean(times[(r, s)][k] for r in ranks) / m / 1e3
                for k in ("f", "b", "w")}
        ars = {k: statistics.fmean(tr.ar[(r, s)][k] for r in ranks) / m / 1e3
               for k in ("ar", "ar_b", "a2a")}
        f_units = [c for (r, name), c in tr.f_units.items() if _stage_of(name) == s and c]
        rows.append(StageCost(vals["f"], vals["b"], vals["w"], ars["ar"], ars["ar_b"],
                              mem_b=counts[s] * share, mem_w=0.0,
                              units=max(1, min(128, max(f_units, default=2))),
                              a2a=ars["a2a"] / 2))  # one F's or one B's
    return StageCosts(tuple(rows), tr.latency(n) / 1e3,
                      tuple(counts) if part is not None else None)


def _stage_of(name: str) -> int | None:
    m = _PASS.match(name)
    return None if m is None else int(m[1])


def load_measured(path: str | Path) -> StageCosts:
    """`measured_stage_costs` of the trace file at `path`; ValueError naming it."""
    doc = read_json(path, MAX_TRACE_BYTES)
    try:
        return measured_stage_costs(doc, str(path))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"{str(path)!r}: a trace event lacks a field or holds a bad "
                         f"value ({str(e)[:80]})") from None
