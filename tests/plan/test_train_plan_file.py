"""`stp train --plan PLAN.json`: plan #1's settings, checked like flags, refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stp.cli.main import main
from stp.train.run import plan_file

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--steps", "2", "--timeout", "60",
        "--json"]
JOB = {"pp": 1, "tp": 1, "dp": 1, "schedule": "1f1b", "microbatches": 2,
       "microbatch_size": 1, "seq_len": 8, "dtype": "float64"}


def _plan(tmp_path: Path, job: dict, name: str = "plan.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"format": 1, "plans": [{"job": job, "flags": []}]}))
    return str(path)


def _losses(capsys, argv) -> list[float]:
    assert main(["train", *argv]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return [r["loss"] for r in rows if "loss" in r]


def test_plan_runs_as_its_flags_do(capsys, tmp_path):
    flags = ["--pp", "1", "--schedule", "1f1b", "-m", "2", "--microbatch-size", "1",
             "--seq-len", "8", "--dtype", "float64"]
    by_flags = _losses(capsys, [*TINY, *flags, "--out", str(tmp_path / "a")])
    by_plan = _losses(capsys, [*TINY, "--plan", _plan(tmp_path, JOB), "--out",
                               str(tmp_path / "b")])
    assert len(by_plan) == 2 and by_plan == by_flags


@pytest.mark.parametrize("job,extra,message", [
    ({**JOB, "pp": "1"}, [], "pp='1' is not a valid int for --pp"),
    ({**JOB, "dtype": "float8"}, [], "dtype='float8' not accepted by --dtype"),
    ({**JOB, "warp": 3}, [], "unknown setting 'warp'"),
    (JOB, ["--tp", "2"], "--tp 2 disagrees with --plan"),
    ({**JOB, "pp": 0}, [], "pp=0"),
])
def test_bad_plans_are_one_line(capsys, tmp_path, job, extra, message):
    out = ["--out", str(tmp_path / "run")]
    assert main(["train", *TINY, "--plan", _plan(tmp_path, job), *extra, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_a_setting_this_build_lacks_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(plan_file.PLAN_KEYS, "warp_drive", bool)
    path = _plan(tmp_path, {**JOB, "warp_drive": True})
    assert main(["train", *TINY, "--plan", path]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs --warp-drive, which this build" in err


@pytest.mark.parametrize("text", ["[1, 2]", '{"format": 2, "plans": []}', "not json",
                                  '{"format": 1, "plans": [3]}'])
def test_not_a_plan_is_one_line(capsys, tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    assert main(["train", *TINY, "--plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("stp: error:")
