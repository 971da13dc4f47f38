"""`stp bench peer`: its flags, and one-line refusals (exit 2) before any worker starts."""

import pytest

from stp.cli.main import main


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_flags(capsys):
    code, out, _ = run(capsys, "bench", "peer", "--help")
    assert code == 0
    for flag in ("--schedules", "--layers", "--hidden", "--seq-len", "--microbatch-size",
                 "-m", "--pairs", "--csv", "--json"):
        assert flag in out


@pytest.mark.parametrize("argv, says", [
    (("--hidden", "x"), "--hidden"),
    (("--pairs", "0"), "--pairs"),
    (("-m", "-3"), "--microbatches"),
    (("--csv", "maybe"), "--csv"),
    (("--schedules", "stp"), "'stp'"),
    (("--hidden", "30"), "hidden=30"),
    (("--layers", "3", "--schedules", "zb-v"), "--layers 3"),
    (("--heads", "3", "--hidden", "48", "--settings", "tp2-eager"), "tp 2 not accepted"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, says):
    code, out, err = run(capsys, "bench", "peer", *argv)
    assert code == 2
    assert says in err and len(err.strip().splitlines()) == 1


def test_settings_flag_refuses_an_unknown_setting(capsys):
    code, _, err = run(capsys, "bench", "peer", "--settings", "tp1-eager,tp4-eager")
    assert code == 2
    assert "'tp4-eager'" in err and "tp2-compiled" in err
    assert len(err.strip().splitlines()) == 1


def test_settings_flag_is_listed(capsys):
    code, out, _ = run(capsys, "bench", "peer", "--help")
    assert code == 0 and "--settings" in out and "tp2-compiled" in out
