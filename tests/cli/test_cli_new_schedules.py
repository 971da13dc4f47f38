"""The CLI on looped-bfs, zb-interleaved and dualpipev: --chunks for the
looped two, the note where PyTorch refuses (p, m), one-line refusals, and
DualPipeV's OVERLAP_F_B rows through `stp export` and back."""

import json

import pytest

from stp.cli.main import main
from stp.schedule import generate, io


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["looped-bfs", "zb-interleaved"])
def test_chunks_option(capsys, name):
    code, out, _ = run(capsys, "simulate", "--schedule", name, "--pp", "4", "-m", "8",
                       "--chunks", "3", "--json")
    assert code == 0
    assert json.loads(out)["chunks"] == 3


def test_chunks_refused_for_dualpipev_in_one_line(capsys):
    code, _, err = run(capsys, "simulate", "--schedule", "dualpipev", "--pp", "2", "-m", "4",
                       "--chunks", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--chunks applies to 1f1b-interleaved, looped-bfs, zb-interleaved only" in err


@pytest.mark.parametrize(("name", "m", "says"), [
    ("dualpipev", 5, "refuses m=5 < 2p=8; this is its m=8 order with microbatches 5..7"),
    ("zb-interleaved", 9, "refuses m=9 (its 2 rounds do not divide it); this runs groups 5/4"),
])
def test_note_where_torch_refuses(capsys, name, m, says):
    code, out, _ = run(capsys, "simulate", "--schedule", name, "--pp", "4", "-m", str(m))
    assert code == 0
    assert says in out
    code, out, _ = run(capsys, "simulate", "--schedule", name, "--pp", "4", "-m", "16")
    assert code == 0 and "note:" not in out


def test_export_dualpipev_and_read_back(capsys, tmp_path):
    path = tmp_path / "dpv.csv"
    code, _, _ = run(capsys, "export", "--schedule", "dualpipev", "--pp", "2", "-m", "6",
                     "--format", "torch-csv", "--out", str(path))
    assert code == 0
    assert "OVERLAP_F_B" in path.read_text()
    assert io.load_csv(path).actions == generate("dualpipev", 2, 6).actions
    code, out, _ = run(capsys, "simulate", "--from-csv", str(path), "--json")
    assert code == 0
    want = run(capsys, "simulate", "--schedule", "dualpipev", "--pp", "2", "-m", "6",
               "--json")[1]
    assert json.loads(out)["makespan"] == json.loads(want)["makespan"]


def test_compare_lists_them_and_offload_lowers_their_peak(capsys):
    code, out, _ = run(capsys, "compare", "--pp", "4", "-m", "8", "--cost",
                       "f=2,b=2,w=1,ar=0.4", "--json")
    assert code == 0
    rows = {r["schedule"]: r for r in json.loads(out)["rows"]}
    assert {"looped-bfs", "zb-interleaved", "dualpipev"} <= set(rows)
    for name in ("looped-bfs", "zb-interleaved", "dualpipev"):
        code, out, _ = run(capsys, "simulate", "--schedule", name, "--pp", "4", "-m", "8",
                           "--offload", "all", "--offload-bandwidth", "4", "--json")
        assert code == 0
        res = json.loads(out)
        assert res["offloaded_passes"] > 0
        assert max(res["peak_activation"]) < max(rows[name]["peak_activation"])
