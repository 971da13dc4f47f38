"""`stp train`'s numeric flags (derived from TrainJob by stp.cli.flags): NaN, inf
and out-of-range values are argument errors naming the flag, before anything runs."""

from __future__ import annotations

import pytest

from stp.cli.main import main


@pytest.mark.parametrize("flag,value,message", [
    ("--lr", "nan", "'nan' must be a finite number"),
    ("--lr", "inf", "'inf' must be a finite number"),
    ("--lr", "-inf", "'-inf' must be a finite number"),
    ("--lr", "0", "0 must be > 0"),
    ("--lr", "-1e-3", "-1e-3 must be > 0"),
    ("--lr", "fast", "'fast' is not a number"),
    ("--timeout", "0", "0 must be > 0"),
    ("--timeout", "nan", "'nan' must be a finite number"),
    ("--timeout", "1e999", "'1e999' must be a finite number"),
    ("--steps", "0", "0 must be >= 1"),
    ("--steps", "-5", "-5 must be >= 1"),
    ("--steps", "1.5", "'1.5' is not an integer"),
    ("--steps", "nan", "'nan' is not an integer"),
    ("--pp", "0", "0 must be >= 1"),
    ("--tp", "-2", "-2 must be >= 1"),
    ("--dp", "0", "0 must be >= 1"),
    ("--microbatches", "0", "0 must be >= 1"),
    ("--microbatch-size", "0", "0 must be >= 1"),
    ("--layers", "0", "0 must be >= 1"),
    ("--hidden", "1e3", "'1e3' is not an integer"),
    ("--heads", "0", "0 must be >= 1"),
    ("--seq-len", "0", "0 must be >= 1"),
    ("--seed", "-1", "-1 must be >= 0"),
])
def test_bad_number_is_one_line_naming_the_flag(capsys, flag, value, message) -> None:
    code = main(["train", f"{flag}={value}"])  # "=": argparse reads "-inf" as a flag
    err = capsys.readouterr().err
    assert code == 2
    assert f"argument {flag}" in err and message in err, err
    assert err.count("\n") == 1, err


def test_steps_zero_is_refused_before_any_worker(capsys) -> None:
    """It used to start the workers and write an untrained checkpoint."""
    assert main(["train", "--steps", "0", "--out", "/nonexistent/never-created"]) == 2
    assert "argument --steps: 0 must be >= 1" in capsys.readouterr().err
