"""Chrome / Perfetto trace of a simulated timeline."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from stp.schedule import generate
from stp.sim import LANES, Costs, Span, simulate
from stp.viz import trace_events, trace_json, write_trace


@pytest.fixture(scope="module")
def res():
    return simulate(generate("stp", 2, 6), Costs(f=2, b=2, w=2, ar=0.4, comm=0.1), layers=2)


def test_every_span_is_a_complete_event_with_its_args(res):
    doc = trace_json(res)
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["schedule"] == "stp"
    units = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "action"]
    assert len(units) == len(res.spans)
    by_key = {(e["pid"], e["tid"], e["ts"], e["name"], e["args"].get("unit")): e for e in units}
    for s in res.spans:
        e = by_key[(s.rank, LANES.index(s.lane), round(s.start * 1000, 3), s.name, s.unit)]
        assert e["dur"] == pytest.approx((s.end - s.start) * 1000, abs=2e-3)
        assert (e["args"]["mb"], e["args"]["stage"], e["args"]["kind"]) == (s.mb, s.stage, s.kind)


def test_actions_are_named_like_the_action_and_nest_their_units(res):
    events = trace_json(res)["traceEvents"]
    actions = [e for e in events if e["ph"] == "X" and e["cat"] == "action"]
    want = sorted((r, str(a)) for r, acts in enumerate(res.schedule.actions) for a in acts)
    assert sorted((e["pid"], e["name"]) for e in actions) == want
    lone = next(e for e in actions if e["name"] == "0F3")
    assert lone["args"] | {"action_index": 0} == {
        "action_index": 0, "passes": ["0F3"], "braided": False, "stage": 0, "mb": 3, "kind": "F"}
    # units sit inside their action on the compute thread (proper nesting for Perfetto)
    per_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e["tid"] == 0:
            per_thread[e["pid"]].append(e)
    for evs in per_thread.values():
        stack: list[float] = []
        for e in evs:  # already sorted: start, then parents (longer) first
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-9, e
            stack.append(end)


def test_process_and_thread_names_and_memory_counter(res, tmp_path):
    path = tmp_path / "t.json"
    write_trace(res, path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[(1, LANES.index("tp"))] == "tp"
    procs = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert procs == ["rank 0", "rank 1"]
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == 1]
    assert [(c["ts"], c["args"]["resident"]) for c in counters] == [
        (round(t * 1000, 3), v) for t, v in res.memory[1]]


def test_measured_spans_without_a_schedule_and_bad_lanes():
    spans = [Span(0, "compute", 0.0, 0.5, "0F0", "F", 0, 0, 0, 0, 0, False),
             Span(0, "compute", 0.5, 1.0, "0F0", "F", 0, 0, 0, 1, 0, False)]
    events = trace_events(spans, time_scale=1.0)
    action = [e for e in events if e.get("cat") == "action"]
    assert len(action) == 1 and action[0]["name"] == "0F0" and action[0]["dur"] == 1.0
    with pytest.raises(ValueError, match="lane 'gpu'"):
        trace_events([Span(0, "gpu", 0, 1, "0F0", "F", 0, 0, 0)])
    empty = simulate(generate("1f1b", 2, 2), record_spans=False)
    with pytest.raises(ValueError, match="record_spans"):
        write_trace(empty, "unused.json")
