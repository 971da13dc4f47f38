"""The trace format: Chrome / Perfetto JSON of a timeline (ui.perfetto.dev,
chrome://tracing), simulated or measured.

One process per rank (`pid` = rank), one thread per lane (compute, tp, send,
d2h, h2d), every action a complete event ("ph": "X") named like the action
(`7F3`, `(7F1;7I0)OVERLAP_F_B`) with its units nested inside as events named
like their pass, and each rank's resident activation memory as a counter.
A unit event's args name its layer and part: measured units by their name in
the stage (`layers.3.moe.experts` -> layer 3, part `moe.experts`: an
expert-parallel MoE layer runs four units, attention, route, experts and
combine), simulated ones as the simulator cuts a layer (attention, MLP).
The runtime (stp.runtime.trace) writes measured runs through the same functions
(same names, same args), so a simulated and a measured trace open side by side;
the format sits here, below both the runtime and stp.viz, because it is the
shape of the simulator's `Span`s.

Times: the simulator's time unit becomes `time_scale` microseconds (default
1000, i.e. one unit shows as one millisecond).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stp.files import write_text_atomic
from stp.schedule.io import parse_action
from stp.schedule.ir import passes_of
from stp.sim.result import LANES, SimResult, Span

__all__ = ["trace_document", "trace_events", "trace_json", "write_trace", "write_trace_document"]

_UNIT_PART = ("attention", "mlp")
"""The simulator's two units per layer, in order."""
_LABEL = re.compile(r"layers\.(\d+)\.([a-z_][a-z0-9_.]*)")
"""A unit's name in a runtime stage: `layers.<layer>.<part>`, part `attn`, `mlp`,
`moe`, or under expert parallelism `moe.route`, `moe.experts`, `moe.combine`."""


def _layer_part(s: Span) -> tuple[int, str]:
    """(layer, part) of a unit span: from its label where the runtime named it
    (layers differ in their units: an expert-parallel MoE layer has four), else
    the simulator's two units per layer."""
    assert s.unit is not None
    m = _LABEL.fullmatch(s.label) if s.label is not None else None
    if m is not None:
        return int(m.group(1)), m.group(2)
    return s.unit // 2, _UNIT_PART[s.unit % 2]


def _us(t: float, scale: float) -> float:
    return round(t * scale, 3)


def _span_args(s: Span) -> dict[str, object]:
    args: dict[str, object] = {"stage": s.stage, "mb": s.mb, "kind": s.kind, "chunk": s.chunk,
                               "action_index": s.action_index, "braided": s.braided}
    if s.unit is not None:
        args["unit"] = s.unit
        args["layer"], args["part"] = _layer_part(s)
    return args


def _action_args(name: str, index: int) -> dict[str, object]:
    """Args of an action event: its passes, and stage / mb / kind (F, B, W, BW) of a lone pass."""
    try:
        action = parse_action(name)
    except ValueError:
        return {"action_index": index}
    ps = passes_of(action)
    args: dict[str, object] = {"action_index": index, "passes": [str(p) for p in ps],
                               "braided": len(ps) > 1}
    if len(ps) == 1:
        args.update(stage=ps[0].stage, mb=ps[0].mb, kind=ps[0].kind.label)
    else:
        args["kind"] = "OVERLAP_F_B"
    return args


def trace_events(
    spans: Iterable[Span],
    *,
    memory: Sequence[Sequence[tuple[float, float]]] | None = None,
    action_names: dict[tuple[int, int], str] | None = None,
    time_scale: float = 1000.0,
) -> list[dict[str, object]]:
    """Trace events of `spans` (simulated or measured; both are `Span`s).

    `action_names[(rank, action_index)]` names the enclosing action events of
    the compute lane (default: the pass name of its first unit).
    """
    spans = list(spans)
    events: list[dict[str, object]] = []
    ranks = sorted({s.rank for s in spans} | set(range(len(memory or []))))
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                       "args": {"sort_index": r}})
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                           "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid,
                           "args": {"sort_index": tid}})
    timed: list[dict[str, Any]] = []  # JSON values of several types; pid..dur are numbers
    groups: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        if s.lane not in LANES:
            raise ValueError(f"span lane {s.lane!r} is not one of {', '.join(LANES)}")
        ts, end = _us(s.start, time_scale), _us(s.end, time_scale)
        timed.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": s.rank,
                      "tid": LANES.index(s.lane), "ts": ts, "dur": round(end - ts, 3),
                      "args": _span_args(s)})
        if s.lane == "compute" and s.action_index >= 0:
            groups[(s.rank, s.action_index)].append(s)
    for (r, idx), group in groups.items():
        ts = min(_us(s.start, time_scale) for s in group)
        end = max(_us(s.end, time_scale) for s in group)
        name = (action_names or {}).get((r, idx), group[0].name)
        timed.append({"ph": "X", "name": name, "cat": "action", "pid": r, "tid": 0, "ts": ts,
                      "dur": round(end - ts, 3), "args": _action_args(name, idx)})
    # parents first: earlier start, then longer duration
    timed.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    events += timed
    for r, points in enumerate(memory or []):
        for t, val in points:
            events.append({"ph": "C", "name": "activation memory (M_B)", "pid": r, "tid": 0,
                           "ts": _us(t, time_scale), "args": {"resident": val}})
    return events


def trace_json(res: SimResult, *, time_scale: float = 1000.0) -> dict[str, object]:
    """The whole trace document of a simulation result."""
    sch = res.schedule
    names = {(r, i): str(a) for r, acts in enumerate(sch.actions) for i, a in enumerate(acts)}
    return trace_document(
        trace_events(res.spans, memory=res.memory, action_names=names, time_scale=time_scale),
        {
            "source": "stp simulator",
            "schedule": sch.name,
            "pp": sch.num_ranks,
            "microbatches": sch.num_microbatches,
            "chunks": sch.chunks,
            "layers": res.layers,
            "costs": {k: getattr(res.costs, k) for k in ("f", "b", "w", "ar", "comm")},
            "time_scale_us_per_unit": time_scale,
            "makespan": res.makespan,
        },
    )


def trace_document(events: list[dict[str, object]],
                   other: Mapping[str, object]) -> dict[str, object]:
    """A trace file's whole document: its events and, under `otherData`, what
    produced them (`source`, the schedule, the time scale)."""
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(other)}


def write_trace_document(path: str | Path, doc: Mapping[str, object]) -> None:
    """Write a trace document atomically; an unwritable path is one ValueError."""
    try:
        write_text_atomic(path, json.dumps(doc))
    except OSError as e:
        raise ValueError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


def write_trace(res: SimResult, path: str | Path, *, time_scale: float = 1000.0) -> None:
    """Write the trace of `res` to `path` (open it in ui.perfetto.dev)."""
    if not res.spans:
        raise ValueError("the simulation result has no spans; simulate with record_spans=True")
    write_trace_document(path, trace_json(res, time_scale=time_scale))
