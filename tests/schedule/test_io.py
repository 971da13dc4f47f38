"""CSV (PyTorch compute-only) and JSON exchange of schedules (stp.schedule.io)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stp.schedule import Block, Kind, Pass, Schedule, generate, io, validate
from stp.schedule.limits import MAX_ACTIONS, MAX_FILE_BYTES
from stp.schedule.registry import SCHEDULES

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def _all(p: int, m: int) -> list[Schedule]:
    return [generate(n, p, m) for n in SCHEDULES]


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 6), (4, 12)])
def test_csv_round_trip_every_schedule(p, m):
    for sch in _all(p, m):
        back = io.load_csv(io.dump_csv(sch), name=sch.name)
        assert back == sch, sch.name  # same placement, microbatches, actions
        assert back.meta == {"source": "csv"}


@pytest.mark.parametrize(("p", "m"), [(2, 6), (4, 12)])
def test_json_round_trip_exactly_meta_included(p, m):
    for sch in _all(p, m):
        back = io.load_json(io.dump_json(sch))
        assert back == sch
        assert back.meta == sch.meta, sch.name


@settings(max_examples=15, deadline=None)
@given(p=st.integers(1, 5), extra=st.integers(0, 6), name=st.sampled_from(sorted(SCHEDULES)))
def test_round_trips_hold_for_any_size(p, extra, name):
    m = 1 + extra
    sch = generate(name, p, m)
    assert io.load_csv(io.dump_csv(sch), name=name) == sch
    assert io.load_json(io.dump_json(sch)) == sch


def test_dump_csv_is_pytorch_text():
    sch = Schedule("t", 2, 2, (0, 1, 1, 0), (
        (Pass(0, F, 0), Pass(0, F, 1), Block((Pass(0, F, 1), Pass(3, B, 0)))),
        (Pass(1, F, 0), Pass(2, BW, 0)),
    ))
    rows = io.dump_csv(sch).splitlines()
    assert rows == ["0F0,0F1,(0F1;3I0)OVERLAP_F_B", "1F0,2B0"]


def test_reads_files_pytorch_bubbles_and_crlf(tmp_path):
    # PyTorch's _dump_csv writes its bubbles (None) as empty cells, with \r\n line ends
    text = "0F0,,0F1,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n\r\n"
    path = tmp_path / "order.csv"
    path.write_text(text, newline="")
    for source in (path, str(path)):
        sch = io.load_csv(source)
        assert sch.name == "order"
        assert sch.stage_to_rank == (0, 1)
        assert sch.num_microbatches == 2
        assert [str(a) for a in sch.actions[1]] == ["1F0", "1B0", "1F1", "1B1"]


def test_placement_inferred_from_rows():
    sch = generate("zb-v", 3, 6)
    assert io.load_csv(io.dump_csv(sch)).stage_to_rank == (0, 1, 2, 2, 1, 0)


_GOOD = "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1"


@pytest.mark.parametrize(("text", "where", "what"), [
    ("0F0,0X1,0B0", "row 0 (rank 0), cell 1", "unknown action '0X1'"),
    ("0F0,0F1,0B0,0B1\n1F0,1F1,1I0,1W0,1SEND_B1", "row 1 (rank 1), cell 4",
     "communication/FSDP action"),
    ("0F0,0B1,0F1,0B0", "row 0 (rank 0), cell 1", "full backward 0B1 comes before its forward 0F1"),
    ("0F0,0W0,0I0", "row 0 (rank 0), cell 1", "0W0 comes before its input-gradient backward 0I0"),
    ("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1,0F2", "row 1 (rank 1), cell 4",
     "stage 0 of '0F2' is already on rank 0"),
    ("0F0,0F1,0B0,0B1\n1F0,1B0", "row 1 (rank 1)", "inconsistent microbatch counts"),
    ("0F0,0F1,0B0,0B1\n1F0,1F1,1I0,1B1", "row 1 (rank 1)", "missing microbatch 0"),
    ("0F0,0I0,0B0", "row 0 (rank 0), cell 2", "repeats the backward (I or B) of stage 0"),
    ("0F0,1F0,0B0,1B0", "row 0 (rank 0), cell 2", "waits for B(stage 1, mb 0)"),
    ("0F0,0F1,(0F2;0I2),0W2", "row 0 (rank 0), cell 2", "unknown action"),
    ("0F0,(1F0;0I0)OVERLAP_F_B,0W0\n1F1", "row 1 (rank 1), cell 0",
     "stage 1 of '1F1' is already on rank 0"),
])
def test_malformed_csv_names_row_and_cell(text, where, what):
    with pytest.raises(ValueError) as e:
        io.load_csv(text)
    msg = str(e.value)
    assert msg.startswith(where), msg
    assert what in msg, msg
    assert "\n" not in msg


def test_microbatch_out_of_range_and_count_mismatch():
    with pytest.raises(ValueError, match=r"row 0 \(rank 0\), cell 1: microbatch 2 of 0F2 is "
                       r"outside 0..1"):
        io.load_csv("0F0,0F2,0B0,0B2", num_microbatches=2)
    with pytest.raises(ValueError, match="runs 2 forward .F. passes, expected 3"):
        io.load_csv(_GOOD, num_microbatches=3)
    assert io.load_csv(_GOOD, num_microbatches=2).num_microbatches == 2


def test_braided_block_with_dependent_passes_is_refused_at_its_cell():
    with pytest.raises(ValueError, match=r"^row 0 \(rank 0\), cell 2 .*inside the same braided"):
        io.load_csv("0F0,0F1,(0F2;0I2)OVERLAP_F_B,0I0,0I1,0W0,0W1,0W2")


def test_unequal_stage_counts_and_missing_stage():
    with pytest.raises(ValueError, match="unequal stage counts"):
        io.load_csv("0F0,1F0,1B0,0B0\n2F0,2B0")
    with pytest.raises(ValueError, match=r"stages \[1\] appear on no rank"):
        io.load_csv("0F0,0B0\n2F0,2B0")


def test_file_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        io.load_csv(str(tmp_path / "missing.csv"))
    with pytest.raises(ValueError, match="no such file"):
        io.load_json(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="holds no rows"):
        io.load_csv("\n\n")


def test_json_is_hand_editable(tmp_path):
    sch = generate("1f1b", 2, 3)
    text = io.dump_json(sch)
    obj = json.loads(text)
    # braces, the keys but "actions" on a line each, then one line per rank
    assert len(text.splitlines()) == 2 + (len(obj) - 1) + 2 + sch.num_ranks
    # swap two independent forwards of rank 0 by hand: still valid, and it runs
    assert obj["actions"][0][:2] == ["0F0", "0F1"]
    obj["actions"][0][:2] = ["0F1", "0F0"]
    obj["name"] = "edited"
    path = Path(tmp_path / "s.json")
    path.write_text(json.dumps(obj))
    edited = io.load_json(path)
    assert edited.name == "edited"
    assert str(edited.actions[0][0]) == "0F1"
    validate(edited)
    # an edit that breaks a dependency is refused, naming rank and position
    obj["actions"][1] = list(reversed(obj["actions"][1]))
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"rank 1, position 0"):
        io.load_json(path)


@pytest.mark.parametrize(("patch", "what"), [
    ({"format": "other"}, '"format": "stp-schedule"'),
    ({"version": 9}, "unsupported version 9"),
    ({"num_ranks": "2"}, "num_ranks='2' must be an integer"),
    ({"stage_to_rank": [0, "x"]}, "must list integers"),
    ({"actions": [["0F0", "zz"], []]}, r"actions\[0\]\[1\] \(rank 0\): unknown action 'zz'"),
])
def test_bad_json_is_refused(patch, what):
    obj = json.loads(io.dump_json(generate("gpipe", 2, 2)))
    obj.update(patch)
    with pytest.raises(ValueError, match=what):
        io.load_json(json.dumps(obj))
    with pytest.raises(ValueError, match="not valid JSON"):
        io.load_json("{nope")


# -- hostile input: every refusal a ValueError, before the work it would cost --


def test_byte_order_mark_and_crlf_are_accepted(tmp_path):
    sch = generate("zb-v", 2, 4)
    text = "\ufeff" + io.dump_csv(sch).replace("\n", "\r\n")
    assert io.load_csv(text, name="zb-v") == sch
    path = tmp_path / "excel.csv"
    path.write_bytes(text.encode("utf-8"))
    assert io.load_csv(path, name="zb-v") == sch
    path = tmp_path / "s.json"
    path.write_bytes(("\ufeff" + io.dump_json(sch).replace("\n", "\r\n")).encode("utf-8"))
    assert io.load_json(path) == sch


@pytest.mark.parametrize("cell", ["0F\uff10", "\uff10F0", "0F\u0660", "(0F0;0I\uff11)OVERLAP_F_B"])
def test_non_ascii_digits_are_refused(cell):
    with pytest.raises(ValueError, match=r"^row 0 \(rank 0\), cell 1: .*non-ASCII"):
        io.load_csv(f"0F0,{cell},0B0")
    obj = json.loads(io.dump_json(generate("gpipe", 1, 1)))
    obj["actions"][0][0] = cell
    with pytest.raises(ValueError, match=r"^actions\[0\]\[0\] \(rank 0\): .*non-ASCII"):
        io.load_json(json.dumps(obj))


@pytest.mark.parametrize(("cell", "what"), [
    ("0F99999999999", "microbatch index '99999999999' is outside 0..4095"),
    ("0F4096", "microbatch index '4096' is outside 0..4095"),
    ("1024F0", "stage index '1024' is outside 0..1023"),
    ("0F" + "0" * 5000 + "1", "microbatch index"),
    ("(0F1;99999999999I0)OVERLAP_F_B", "stage index '99999999999'"),
])
def test_indices_past_the_limits_are_refused_before_parsing(cell, what):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^row 0 \(rank 0\), cell 1: ") as e:
        io.load_csv(f"0F0,{cell}")
    assert what in str(e.value)
    assert time.monotonic() - start < 1.0


def test_counts_past_the_limits_are_refused():
    with pytest.raises(ValueError, match="num_microbatches=5000: accepted are 1..4096"):
        io.load_csv("0F0,0B0", num_microbatches=5000)
    with pytest.raises(ValueError, match="65 rows"):
        io.load_csv("\n".join(f"{r}F0,{r}B0" for r in range(65)))
    with pytest.raises(ValueError, match=f"{MAX_ACTIONS + 1} actions"):
        io.load_csv(",".join(["0F0"] * (MAX_ACTIONS + 1)))
    obj = json.loads(io.dump_json(generate("gpipe", 1, 1)))
    for key, val, what in [("num_microbatches", 10**11, "num_microbatches=100000000000 is beyond"),
                           ("num_ranks", 10**11, "num_ranks=100000000000 is beyond"),
                           ("stage_to_rank", [0] * 1025, "1025 stages"),
                           ("actions", [[]] * 65, "65 ranks' lists")]:
        with pytest.raises(ValueError, match=what):
            io.load_json(json.dumps(dict(obj, **{key: val})))


def test_a_missing_microbatch_is_named_without_listing_them_all():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"runs 1 forward .F. passes, expected 4096 .*"
                       r"missing microbatch 1, 2, 3, 4, 5, 6, 7, 8, \.\.\.$"):
        io.load_csv("0F0,0B0", num_microbatches=4096)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(("text", "what"), [
    ("0F0,0B0\x00", "unknown action"),
    ('"' + "x" * 200_000 + '"', "not a readable CSV: field larger than field limit"),
    ("x" * (MAX_FILE_BYTES + 1), "at most 4194304 are read"),
])
def test_unreadable_csv_text_is_a_value_error(text, what):
    with pytest.raises(ValueError, match=what):
        io.parse_csv(text)


@pytest.mark.parametrize(("text", "what"), [
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 32 levels"),
    ("[" * 33 + "]" * 33, "nested deeper than 32 levels"),
    ('{"format": "stp-schedule", "version": NaN}', "NaN is not a JSON number"),
    ('{"format": "stp-schedule", "version": -Infinity}', "-Infinity is not a JSON number"),
    ("1" * 5000, "not valid JSON for a schedule"),
])
def test_hostile_json_is_a_value_error(text, what):
    with pytest.raises(ValueError, match=what):
        io.parse_json(text)


def test_deep_meta_is_refused_but_a_schedule_nests_three_deep():
    obj = json.loads(io.dump_json(generate("gpipe", 1, 1)))
    obj["meta"] = {"x": json.loads("[" * 30 + "]" * 30)}  # the object, meta, 30 lists: 32
    assert io.load_json(json.dumps(obj)).name == "gpipe"
    obj["meta"] = {"x": json.loads("[" * 31 + "]" * 31)}
    with pytest.raises(ValueError, match="nested deeper than 32"):
        io.load_json(json.dumps(obj))


def test_a_file_is_a_file_whatever_its_name(tmp_path, monkeypatch):
    sch = generate("1f1b", 2, 2)
    path = tmp_path / "run,v2.csv"
    path.write_text(io.dump_csv(sch))
    assert io.load_csv(str(path)).name == "run,v2"  # an existing file, though it holds a comma
    assert io.load_csv(path).name == "run,v2"
    with pytest.raises(ValueError, match="no such file"):
        io.load_csv(tmp_path / "0F0,0B0")  # a Path is always a file
    with pytest.raises(ValueError, match="no such file"):
        io.load_csv(str(tmp_path / "missing"))  # a path separator: no action has one
    monkeypatch.chdir(tmp_path)
    (tmp_path / "0F0").write_text(io.dump_csv(sch))
    assert io.parse_csv("0F0,0B0").num_microbatches == 1  # parse_csv never reads a file
    with pytest.raises(ValueError, match="larger than 4 MiB"):
        (tmp_path / "big.csv").write_text("0F0," * (MAX_FILE_BYTES // 4 + 1))
        io.load_csv(tmp_path / "big.csv")
    (tmp_path / "latin1.csv").write_bytes(b"0F0,0B0\xff")
    with pytest.raises(ValueError, match="not UTF-8"):
        io.load_csv(tmp_path / "latin1.csv")
    with pytest.raises(ValueError, match="cannot read"):
        io.load_csv(tmp_path)


def _kinds_from_letters() -> list[str]:
    """Every `Kind(...)` call in the package: a letter made into a Kind."""
    import ast

    src = Path(io.__file__).resolve().parents[1]
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and (
                    getattr(node.func, "id", None) == "Kind"
                    or getattr(node.func, "attr", None) == "Kind"):
                out.append(f"{path.relative_to(src)}:{node.lineno}")
    return out


def test_only_io_turns_a_letter_into_a_kind():
    """PyTorch's letters are not our names (Kind("B") is Kind.BW): only the
    exchange module reads them. The scan sees io.py's own reading."""
    found = _kinds_from_letters()
    assert found and all(f.startswith("schedule/io.py:") for f in found), found
    assert Kind("B") is BW and Kind("I") is B
