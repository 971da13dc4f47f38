"""The CLI: tables, JSON fields, and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from stp.cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schedules_lists_every_name(capsys):
    code, out, _ = run(capsys, "schedules")
    names = [line.split()[0] for line in out.splitlines()]
    assert code == 0
    assert names == ["gpipe", "1f1b", "1f1b-interleaved", "zb-h1", "zb-h2", "zb-v",
                     "v-half", "v-min", "stp", "looped-bfs", "zb-interleaved", "dualpipev"]


def test_simulate_json_fields(capsys):
    code, out, _ = run(capsys, "simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--json")
    assert code == 0
    obj = json.loads(out)
    for key in ("schedule", "pp", "microbatches", "makespan", "bubble_rate", "pp_bubble",
                "tp_bubble", "peak_activation", "ranks"):
        assert key in obj
    assert obj["peak_activation"] == [4, 3, 2, 1]
    assert obj["makespan"] == pytest.approx(8 * 3 + 3 * 3)


def test_simulate_table(capsys):
    code, out, _ = run(capsys, "simulate", "--schedule", "stp", "--pp", "4", "-m", "12",
                       "--cost", "f=2,b=2,w=2,ar=0.4")
    assert code == 0 and "makespan" in out and "exposed_tp" in out


def test_compare_sorted_by_makespan(capsys):
    code, out, _ = run(capsys, "compare", "--pp", "4", "-m", "16", "--cost",
                       "f=2,b=2,w=2,ar=0.4", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    spans = [r["makespan"] for r in rows]
    assert spans == sorted(spans)
    assert {r["schedule"] for r in rows} >= {"stp", "zb-v", "1f1b-interleaved", "1f1b"}
    assert max(r["speedup"] for r in rows) == pytest.approx(spans[-1] / spans[0])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["simulate", "--schedule", "nope", "--pp", "2", "-m", "4"], "choose one of: gpipe, 1f1b"),
        (["simulate", "--schedule", "stp", "--pp", "4", "-m", "0"], "0 must be >= 1"),
        (["simulate", "--schedule", "gpipe", "--pp", "2", "-m", "4", "--chunks", "2"],
         "--chunks applies to 1f1b-interleaved, looped-bfs, zb-interleaved only"),
        (["simulate", "--schedule", "1f1b-interleaved", "--pp", "2", "-m", "4", "--chunks", "1"],
         "chunks"),
        (["simulate", "--schedule", "1f1b", "--pp", "0", "-m", "4"], "--pp"),
        (["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4", "--cost", "f=-1"], "f=-1"),
        (["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4", "--cost", "f="], "f=''"),
        (["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4", "--cost", "q=1"], "'q'"),
        (["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--memory-limit", "2"],
         "exceeds the limit 2"),
        (["simulate", "--pp", "4", "-m", "8"], "--schedule"),
        (["compare", "--pp", "2", "-m", "4", "--schedules", "1f1b,bogus"], "'bogus'"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_console_script_exit_status():
    proc = subprocess.run(
        [sys.executable, "-m", "stp.cli.main", "simulate", "--schedule", "zz", "--pp", "2",
         "-m", "2"], capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("stp: error: unknown schedule 'zz'")
    assert "Traceback" not in proc.stderr
