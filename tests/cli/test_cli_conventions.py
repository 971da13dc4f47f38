"""The `stp` command's conventions: `--version`, `python -m stp`, flags spelled
out (no abbreviations), the nearest flag suggested for a misspelled one, and
every refusal one line on stderr that says `stp: error:` once, exit 2."""

import subprocess
import sys

import pytest

import stp
from stp.cli.main import build_parser, main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code, out, err, line):
    assert code == 2
    assert out == ""
    assert err == f"stp: error: {line}\n"


def python_m_stp(*argv):
    return subprocess.run([sys.executable, "-m", "stp", *argv], capture_output=True,
                          text=True, timeout=120)


def test_version_through_python_m_stp():
    proc = python_m_stp("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"stp {stp.__version__}\n"
    assert proc.stderr == ""


def test_python_m_stp_refuses_in_one_line_without_a_traceback():
    proc = python_m_stp("train", "--stpes", "3")
    assert proc.returncode == 2
    assert proc.stderr == ("stp: error: train: unrecognized argument --stpes; "
                           "did you mean --steps?\n")


@pytest.mark.parametrize("argv,line", [
    (("train", "--step", "3"), "train: unrecognized argument --step; did you mean --steps?"),
    (("simulate", "--sched", "1f1b", "--pp", "2", "-m", "4"),
     "simulate: unrecognized argument --sched; did you mean --schedule?"),
    (("bench", "peer", "--pair", "2"),
     "bench peer: unrecognized argument --pair; did you mean --pairs?"),
])
def test_an_abbreviated_flag_is_refused_not_taken_for_the_long_one(capsys, argv, line):
    assert_refused(*run(capsys, *argv), line)


def test_the_full_flag_is_taken_with_or_without_equals():
    parser = build_parser()
    assert parser.parse_args(["train", "--steps", "3"]).steps == 3
    assert parser.parse_args(["train", "--steps=4"]).steps == 4


@pytest.mark.parametrize("argv,line", [
    (("--verison",), "unrecognized argument --verison; did you mean --version?"),
    (("train", "--lr", "0.1", "--stpes=3"),
     "train: unrecognized argument --stpes=3; did you mean --steps?"),
    # a required flag misspelled: the misspelling is named, not the missing flag
    (("export", "--shcedule", "stp", "--pp", "2", "-m", "4"),
     "export: unrecognized argument --shcedule; did you mean --schedule?"),
])
def test_a_misspelled_flag_gets_the_nearest_real_one(capsys, argv, line):
    assert_refused(*run(capsys, *argv), line)


def test_a_flag_like_no_other_is_refused_without_a_suggestion(capsys):
    assert_refused(*run(capsys, "simulate", "--zzz"), "unrecognized arguments: --zzz")


@pytest.mark.parametrize("argv", [
    ("nope",),
    (),
    ("simulate", "-m", "x"),
    ("bench",),
    ("bench", "peer", "--layers", "-1"),
    ("train", "--steps", "many"),
])
def test_every_refusal_says_stp_error_once_on_one_line(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("stp: error: ") and err.count("\n") == 1, err
    assert err.count("error:") == 1 and "stp: error: stp" not in err, err


def test_a_subcommand_error_names_the_subcommand(capsys):
    code, _, err = run(capsys, "simulate", "-m", "x")
    assert code == 2
    assert err.startswith("stp: error: simulate: argument --microbatches/-m: "), err
