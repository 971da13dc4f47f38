"""`stp draw --measured TRACE.json`: a recorded run drawn as it ran, each TP collective
in its own colour and legend entry (AR; RS and AG under sequence parallelism), and
the simulated picture of a sequence-parallel schedule names RS and AG the same way.
A trace is a file a user hands stp: a bad one is one line, exit 2."""

from __future__ import annotations

import json

import pytest

from stp.cli.main import main
from stp.runtime.trace import write_trace
from stp.schedule import generate
from stp.sim.result import Span
from stp.viz.measured import hidden_under_compute

SCH = generate("stp", 2, 4)


def _spans() -> list[Span]:
    """Rank 0 runs a braided block of 1F0 and 0I0 (index 3): 1F0's unit, then 0I0's,
    with 1F0's reduce-scatter under 0I0's unit and an all-gather after it."""
    return [
        Span(0, "compute", 0.000, 0.002, "1F0", "F", 1, 0, 1, 0, 3, True),
        Span(0, "compute", 0.002, 0.004, "0B0", "B", 0, 0, 0, 0, 3, True),
        Span(0, "tp", 0.002, 0.003, "1F0", "RS", 1, 0, 1, 0, 3, True),
        Span(0, "tp", 0.003, 0.004, "1F0", "AG", 1, 0, 1, 1, 3, True),
        Span(0, "tp", 0.004, 0.005, "1F0", "AR", 1, 0, 1, None, 3, True),
        Span(0, "send", 0.004, 0.005, "0SEND_B0", "SEND", 0, 0, 0),
    ]


def _write(tmp_path, spans=None):
    path = tmp_path / "run.json"
    write_trace(path, spans or _spans(), SCH, {0: 0})
    return path


def test_measured_trace_is_drawn_with_each_collective_named(tmp_path, capsys):
    svg = tmp_path / "run.svg"
    assert main(["draw", "--measured", str(_write(tmp_path)), "--out", str(svg)]) == 0
    text = svg.read_text()
    for needle in ("reduce-scatter (RS)", "all-gather (AG)", "TP all-reduce", "RS of 1F0",
                   "AG of 1F0", "braided block", "send / receive", "time (ms, measured)"):
        assert needle in text, needle
    # RS and AG each ran 1 ms, all of it under rank 0's compute; AR after it
    assert "RS 1 ms (100% under compute), AG 1 ms (100% under compute)" in text
    assert "AR 1 ms (0% under compute)" in text


def test_hidden_under_compute_counts_the_overlap_only():
    spans = _spans()
    assert hidden_under_compute(spans, 0, "RS") == pytest.approx((1e-3, 1e-3))
    assert hidden_under_compute(spans, 0, "AR") == pytest.approx((1e-3, 0.0))


def test_a_dp_gradient_reduction_is_drawn_on_its_lane_with_its_share_hidden(tmp_path):
    """A stage's DP reduction launched during the backward (stp.train.step.grad_sync): half
    of it under the compute that follows, half after it."""
    spans = [*_spans(), Span(0, "dp", 0.003, 0.005, "DP-AR stage 1", "DP-AR", 1, 0, 1)]
    svg = tmp_path / "run.svg"
    assert main(["draw", "--measured", str(_write(tmp_path, spans)), "--out", str(svg)]) == 0
    text = svg.read_text()
    assert "DP gradient reduction" in text and "DP-AR of DP-AR stage 1" in text
    assert "DP gradient reductions, all ranks: 2 ms (50% under compute)" in text


def test_simulated_sequence_parallel_picture_names_rs_and_ag(tmp_path, capsys):
    svg = tmp_path / "sim.svg"
    assert main(["draw", "--schedule", "stp", "--pp", "2", "-m", "4", "--cost",
                 "f=2,b=2,w=2,ag=0.2,rs=0.2", "--out", str(svg)]) == 0
    text = svg.read_text()
    assert "reduce-scatter (RS)" in text and "all-gather (AG)" in text
    assert ">TP all-reduce<" not in text


def _doc(tmp_path, edit) -> str:
    doc = json.loads(_write(tmp_path).read_text())
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    return str(bad)


def _first(doc: dict, cat: str) -> dict:
    return next(e for e in doc["traceEvents"] if e.get("cat") == cat)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["otherData"].update(source="stp simulator"), "not a measured trace"),
    (lambda d: d.pop("traceEvents"), "no traceEvents list"),
    (lambda d: _first(d, "tp").update(pid="0"), "pid '0' is not an integer"),
    (lambda d: _first(d, "tp")["args"].update(kind="XX"), "kind 'XX' is not one of AR"),
    (lambda d: _first(d, "compute").update(dur=-1), "dur -1 is not a finite number"),
    (lambda d: _first(d, "compute").update(ts=1e300), "ts 1e+300 is not a finite number"),
    (lambda d: _first(d, "compute").update(name="x" * 300), "is not a string of 1 to 256"),
    (lambda d: d.update(traceEvents=[e for e in d["traceEvents"]
                                     if e.get("cat") != "compute"]), "no compute spans"),
], ids=["simulated", "no-events", "pid", "kind", "dur", "ts", "name", "no-compute"])
def test_a_bad_trace_is_one_line(tmp_path, capsys, edit, needle):
    code = main(["draw", "--measured", _doc(tmp_path, edit), "--out", str(tmp_path / "x.svg")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--schedule", "stp"], "drop --schedule"),
    (["--trace", "t.json"], "drop --trace"),
    ([], "needs --out FILE.svg"),
])
def test_measured_refuses_what_it_does_not_take(tmp_path, capsys, argv, needle):
    code = main(["draw", "--measured", str(_write(tmp_path)), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_a_missing_or_non_json_trace_is_one_line(tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\x00\xff not json")
    for path in (junk, tmp_path / "missing.json"):
        code = main(["draw", "--measured", str(path), "--out", str(tmp_path / "x.svg")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and str(path) in err, err
