"""`stp simulate`, `compare` and `draw` with `--tp-overlap`: labels, pieces, refusals."""

import json

import pytest

from stp.cli.main import main

BASE = ["--pp", "2", "-m", "4", "--cost", "f=1,b=1,w=1,ag=0.25,rs=0.25"]


def test_draw_shows_the_mode_and_the_chunk_pieces(tmp_path, capsys):
    out = tmp_path / "zbv.svg"
    assert main(["draw", "--schedule", "zb-v", *BASE, "--tp-overlap", "--tp-overlap-chunks",
                 "2", "--out", str(out)]) == 0
    svg = out.read_text()
    assert "tp overlap both K=2" in svg
    plain = tmp_path / "plain.svg"
    assert main(["draw", "--schedule", "zb-v", *BASE, "--out", str(plain)]) == 0
    # each unit's gather and scatter drawn in two pieces: more TP-lane spans than without
    assert svg.count("all-gather") >= plain.read_text().count("all-gather")
    assert svg.count("<rect") > plain.read_text().count("<rect")


def test_simulate_and_compare_report_the_mode(capsys):
    assert main(["simulate", "--schedule", "stp", *BASE, "--tp-overlap", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["tp_overlap"], got["tp_overlap_chunks"]) == ("both", 4)
    assert main(["simulate", "--schedule", "stp", *BASE, "--braid", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tp_overlap"] == "none"
    assert main(["compare", *BASE, "--schedules", "zb-v,stp", "--tp-overlap", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted((r["schedule"], r["tp_overlap"]) for r in rows) == [
        ("stp", "both"), ("stp", "braided"), ("zb-v", "both"), ("zb-v", "braided")]


@pytest.mark.parametrize("extra, words", [
    (["--tp-overlap-chunks", "4"], "--tp-overlap-chunks needs --tp-overlap"),
    (["--tp-overlap", "--tp-overlap-costs", "efficiency=2"], "efficiency"),
    (["--tp-overlap", "--tp-overlap-costs", "speed=2"], "unknown --tp-overlap-costs key"),
])
def test_bad_overlap_options_are_one_line(capsys, extra, words):
    assert main(["simulate", "--schedule", "zb-v", *BASE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err


def test_bad_chunk_count_is_refused(capsys):
    assert main(["simulate", "--schedule", "zb-v", *BASE, "--tp-overlap",
                 "--tp-overlap-chunks", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--tp-overlap-chunks: 0 must be >= 1" in err
