"""`stp draw`, `stp export`, and the --from-csv / --plot paths through the CLI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from stp.cli.main import main
from stp.schedule import generate, io


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_draw_writes_svg_and_trace(capsys, tmp_path):
    svg, trace = tmp_path / "t.svg", tmp_path / "t.json"
    code, _, err = run(capsys, "draw", "--schedule", "stp", "--pp", "2", "-m", "6",
                       "--cost", "f=2,b=2,w=2,ar=0.4", "--out", str(svg), "--trace", str(trace))
    assert code == 0, err
    assert ET.parse(svg).getroot().tag.endswith("svg")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "(3F1;3I0)OVERLAP_F_B" for e in events)


def test_export_then_draw_and_simulate_from_csv(capsys, tmp_path):
    csv_path = tmp_path / "zbv.csv"
    code, _, _ = run(capsys, "export", "--schedule", "zb-v", "--pp", "3", "-m", "6",
                     "--format", "torch-csv", "--out", str(csv_path))
    assert code == 0
    back, want = io.load_csv(csv_path), generate("zb-v", 3, 6)
    assert back.name == "zbv"
    assert (back.stage_to_rank, back.actions) == (want.stage_to_rank, want.actions)
    code, _, err = run(capsys, "draw", "--from-csv", str(csv_path), "--out",
                       str(tmp_path / "zbv.svg"))
    assert code == 0, err
    code, out, _ = run(capsys, "simulate", "--from-csv", str(csv_path), "--json")
    assert code == 0 and json.loads(out)["pp_bubble"] == pytest.approx(0)


def test_export_to_stdout_round_trips(capsys):
    code, out, _ = run(capsys, "export", "--schedule", "1f1b-interleaved", "--pp", "2", "-m", "4",
                       "--format", "torch-csv")
    assert code == 0
    want = generate("1f1b-interleaved", 2, 4)
    assert io.load_csv(out).actions == want.actions
    code, out, _ = run(capsys, "export", "--schedule", "stp", "--pp", "2", "-m", "5",
                       "--format", "json")
    assert code == 0 and io.load_json(out) == generate("stp", 2, 5)


def test_compare_plot(capsys, tmp_path):
    path = tmp_path / "cmp.svg"
    code, _, err = run(capsys, "compare", "--pp", "2", "-m", "6", "--schedules", "1f1b,stp",
                       "--plot", str(path))
    assert code == 0, err
    labels = [t.text for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert "stp" in labels and "1f1b" in labels


@pytest.mark.parametrize(("argv", "message"), [
    (["draw", "--schedule", "stp", "--pp", "2", "-m", "6", "--out", "x.pdf"], "must end in .svg"),
    (["draw", "--pp", "2", "-m", "6", "--out", "x.svg"], "draw needs --schedule"),
    (["draw", "--schedule", "stp", "--pp", "2", "-m", "6"], "nothing to write"),
    (["draw", "--schedule", "stp", "--pp", "2", "-m", "0", "--out", "x.svg"], "0 must be >= 1"),
    (["export", "--schedule", "stp", "--pp", "2", "-m", "6", "--format", "xml"], "invalid choice"),
    (["export", "--schedule", "nope", "--pp", "2", "-m", "6", "--format", "json"],
     "unknown schedule 'nope'"),
])
def test_user_errors_exit_2_with_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(("text", "message"), [
    ("0F0,0F1,0B1,0Q0\n", "row 0 (rank 0), cell 3: unknown action '0Q0'"),
    ("0F0,0F1,0B1,0F9\n", "row 0 (rank 0), cell 3: microbatch 9"),
    ("0F0,0B1,0F1,0B0\n", "row 0 (rank 0), cell 1: full backward 0B1 comes before"),
    ("0F0,0B0\n1F0,1B0,0F1\n", "row 1 (rank 1), cell 2: stage 0"),
    ("0F0,0F1,0B0,0B1\n1F0,1B0\n", "row 1 (rank 1): inconsistent microbatch counts"),
])
def test_malformed_csv_exit_2(capsys, tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    extra = ["--microbatches", "2"] if "0F9" in text else []
    for cmd in (["draw", "--out", str(tmp_path / "x.svg")], ["simulate"]):
        code, _, err = run(capsys, *cmd, "--from-csv", str(path), *extra)
        assert code == 2
        assert message in err and err.count("\n") == 1, err
