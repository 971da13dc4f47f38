"""Hostile input to the CLI: huge indices and sizes, ambiguous arguments, numbers
that are not numbers. Each is refused with one line on stderr naming the bad
value, exit status 2, within a bound on time and (for files) on memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stp.cli.main import main
from stp.schedule import generate, io
from stp.schedule.limits import MAX_ACTIONS, MAX_FILE_BYTES

MEMORY_BYTES = 512 * 2**20
"""Address space a CLI subprocess gets: the CLI needs about 20 MB to start and
the largest file it reads under 200 MB; the faults fixed here took 4 GB."""
SECONDS = 30
"""CPU seconds a refused input may take (each takes under 2 s): CPU time, not wall
time, so that a loaded machine does not fail the bound; a runaway computation
(the faults fixed here ran for minutes) is killed by RLIMIT_CPU."""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (SECONDS, SECONDS))


def run_bounded(*argv: str) -> tuple[int, str, str]:
    """`stp ARGV` in a subprocess with MEMORY_BYTES of address space and SECONDS of
    CPU (past it the kernel ends the process, which fails the caller's status check);
    a wall timeout far above that catches a hang."""
    proc = subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                          text=True, timeout=SECONDS * 10, preexec_fn=_limit_memory)
    assert proc.returncode >= 0, (argv, f"killed by signal {-proc.returncode}")
    return proc.returncode, proc.stdout, proc.stderr


def run(capsys, *argv: str) -> tuple[int, str, str]:
    start = time.process_time()
    code = main(list(argv))
    assert time.process_time() - start < SECONDS, argv
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_exit_2(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


# -- hostile schedule files (subprocess, bounded memory) -----------------------


@pytest.mark.parametrize(("name", "text", "needles"), [
    ("mb.csv", "0F0,0F99999999999,0B0\n", ["cell 1", "microbatch index", "0..4095"]),
    ("stage.csv", "0F0,99999999999F0\n", ["cell 1", "stage index", "0..1023"]),
    ("deep.json", "[" * 100_000 + "]" * 100_000, ["nested deeper than 32"]),
    ("mbs.json", json.dumps({"format": "stp-schedule", "version": 1, "name": "x",
                             "num_ranks": 1, "num_microbatches": 99999999999,
                             "stage_to_rank": [0], "actions": [["0F0"]]}),
     ["num_microbatches=99999999999", "4096"]),
    ("digits.json", '{"format": "stp-schedule", "n": ' + "9" * 100_000 + "}",
     ["not valid JSON"]),
    ("nan.json", '{"format": "stp-schedule", "version": NaN}', ["NaN"]),
], ids=lambda v: v if isinstance(v, str) and len(v) < 16 else "")  # short ids: pytest puts
# the id in PYTEST_CURRENT_TEST, and a 200 kB one makes the subprocess's environment too long
def test_hostile_file_is_refused_in_bounded_time_and_memory(tmp_path, name, text, needles):
    path = tmp_path / name
    path.write_text(text)
    flag = "--from-csv" if name.endswith(".csv") else "--from-json"
    code, _, err = run_bounded("simulate", flag, str(path))
    assert_one_line_exit_2(code, err, *needles)


def test_file_over_the_size_limit_is_not_read(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text("0F0," * (MAX_FILE_BYTES // 4 + 1))
    code, _, err = run_bounded("simulate", "--from-csv", str(path))
    assert_one_line_exit_2(code, err, "larger than 4 MiB")


@pytest.mark.parametrize("suffix", ["csv", "json"])
def test_too_many_actions_are_counted_before_parsing(tmp_path, suffix):
    n = MAX_ACTIONS + 1
    if suffix == "csv":
        text = ",".join(["0F0"] * n)
    else:
        text = json.dumps({"format": "stp-schedule", "version": 1, "name": "x", "num_ranks": 1,
                           "num_microbatches": 1, "stage_to_rank": [0],
                           "actions": [["0F0"] * n]})
    path = tmp_path / f"many.{suffix}"
    path.write_text(text)
    code, _, err = run_bounded("simulate", f"--from-{suffix}", str(path))
    assert_one_line_exit_2(code, err, f"{n} actions", f"at most {MAX_ACTIONS}")


def test_a_file_past_the_work_limit_is_refused_before_simulating(tmp_path):
    # a valid one-rank schedule of 64 stages x 513 microbatches: 32832 > 32768
    stages, m = 64, 513
    row = []
    for i in range(m):
        row += [f"{s}F{i}" for s in range(stages)] + [f"{s}B{i}" for s in reversed(range(stages))]
    path = tmp_path / "long.csv"
    path.write_text(",".join(row) + "\n")
    code, _, err = run_bounded("simulate", "--from-csv", str(path))
    assert_one_line_exit_2(code, err, "64 stages x 513 microbatches = 32832", "32768")


# -- sizes on the command line -------------------------------------------------


_BIG = [
    (["--pp", "100000", "-m", "8"], "argument --pp: 100000 is beyond 64"),
    (["--pp", "4", "-m", "100000000"], "argument --microbatches/-m: 100000000 is beyond 4096"),
    (["--pp", "64", "-m", "4096"], "128 stages x 4096 microbatches = 524288"),
]


@pytest.mark.parametrize(("size", "needle"), _BIG)
@pytest.mark.parametrize("command", [
    ["simulate", "--schedule", "1f1b"], ["draw", "--schedule", "1f1b", "--out", "x.svg"],
    ["export", "--schedule", "1f1b", "--format", "json"], ["compare"],
    ["search", "--memory-limit", "4"],
])
def test_sizes_past_the_maxima_are_refused_at_once(capsys, command, size, needle):
    code, out, err = run(capsys, *command, *size)
    assert_one_line_exit_2(code, err, needle)
    assert out == ""


@pytest.mark.parametrize(("argv", "needle"), [
    (["--layers", "65"], "argument --layers: 65 is beyond 64"),
    (["--layers", "64", "--pp", "16", "-m", "256"],
     "32 stages x 256 microbatches x 64 layers = 524288"),
    (["--chunks", "17"], "argument --chunks: 17 is beyond 16"),
])
def test_layers_and_chunks_have_maxima(capsys, argv, needle):
    base = {"--pp": "4", "-m": "8"}
    for flag, val in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = val
    extra = [x for kv in base.items() for x in kv]
    code, _, err = run(capsys, "simulate", "--schedule", "1f1b-interleaved", *extra)
    assert_one_line_exit_2(code, err, needle)


def test_the_largest_accepted_simulation_finishes(capsys):
    # at the work limit: 2 chunks x 64 ranks x 256 microbatches = 32768
    code, out, _ = run(capsys, "simulate", "--schedule", "zb-v", "--pp", "64", "-m", "256",
                       "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 256


# -- file arguments are paths --------------------------------------------------


def test_from_csv_reads_a_file_whose_name_holds_a_comma(capsys, tmp_path):
    path = tmp_path / "run,v2.csv"
    path.write_text(io.dump_csv(generate("1f1b", 2, 4)))
    code, out, _ = run(capsys, "simulate", "--from-csv", str(path), "--json")
    assert code == 0 and json.loads(out)["schedule"] == "run,v2"


@pytest.mark.parametrize("flag", ["--from-csv", "--from-json"])
def test_missing_or_unreadable_paths_say_so(capsys, tmp_path, flag):
    for missing in (str(tmp_path / "nope"), str(tmp_path / "a,b"), "{x}"):
        code, _, err = run(capsys, "simulate", flag, missing)
        assert_one_line_exit_2(code, err, "no such file", repr(missing))
    code, _, err = run(capsys, "simulate", flag, str(tmp_path))
    assert_one_line_exit_2(code, err, "cannot read", "directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_a_file_without_read_permission_says_so(capsys, tmp_path):
    path = tmp_path / "locked.csv"
    path.write_text("0F0,0B0\n")
    path.chmod(0)
    code, _, err = run(capsys, "simulate", "--from-csv", str(path))
    assert_one_line_exit_2(code, err, "cannot read", "ermission denied")


def test_schedule_text_is_the_schedule_itself(capsys):
    code, out, _ = run(capsys, "simulate", "--schedule-text", "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1",
                       "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 2
    text = io.dump_json(generate("zb-v", 2, 4))
    code, out, _ = run(capsys, "simulate", "--schedule-text", text, "--json")
    assert code == 0 and json.loads(out)["schedule"] == "zb-v"
    code, _, err = run(capsys, "simulate", "--schedule-text", "run.csv")
    assert_one_line_exit_2(code, err, "unknown action 'run.csv'")
    code, _, err = run(capsys, "simulate", "--schedule-text", "0F0,0B0", "--from-csv", "x.csv")
    assert_one_line_exit_2(code, err, "give one of --from-csv, --schedule-text")


def test_byte_order_mark_and_crlf_are_accepted(capsys, tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n")
    code, out, _ = run(capsys, "simulate", "--from-csv", str(path), "--json")
    assert code == 0 and json.loads(out)["pp"] == 2
    path = tmp_path / "s.json"
    path.write_bytes(b"\xef\xbb\xbf" + io.dump_json(generate("1f1b", 2, 2)).replace(
        "\n", "\r\n").encode())
    code, _, _ = run(capsys, "simulate", "--from-json", str(path))
    assert code == 0


def test_non_ascii_digits_are_refused(capsys, tmp_path):
    path = tmp_path / "wide.csv"
    path.write_text("0F\uff10,0B\uff10\n", encoding="utf-8")
    code, _, err = run(capsys, "simulate", "--from-csv", str(path))
    assert_one_line_exit_2(code, err, "cell 0", "non-ASCII")
    for argv, needle in [
        (["--pp", "\uff14", "-m", "8"], "argument --pp"),
        (["--pp", "4", "-m", "\uff18"], "argument --microbatches/-m"),
        (["--pp", "4", "-m", "8", "--cost", "f=\uff11"], "--cost"),
        (["--pp", "4", "-m", "8", "--offload", "selective:\uff10.5"], "--offload"),
        (["--pp", "4", "-m", "8", "--memory-limit", "\uff14"], "argument --memory-limit"),
    ]:
        code, _, err = run(capsys, "simulate", "--schedule", "1f1b", *argv)
        assert_one_line_exit_2(code, err, needle, "ASCII")


# -- numbers -------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf", "-inf", "1e13", "x"])
@pytest.mark.parametrize("command", [["simulate", "--schedule", "1f1b"], ["search"]])
def test_memory_limit_must_be_a_positive_finite_number(capsys, command, value):
    # "=": argparse reads a separate "-inf" as an option
    code, _, err = run(capsys, *command, "--pp", "4", "-m", "8", f"--memory-limit={value}")
    assert_one_line_exit_2(code, err, "argument --memory-limit", repr(value))


@pytest.mark.parametrize(("flag", "value"), [
    ("--offload-bandwidth", "nan"), ("--offload-bandwidth", "0"), ("--act-bytes", "inf"),
    ("--act-bytes", "-1"),
])
def test_offload_numbers_must_be_positive_and_finite(capsys, flag, value):
    code, _, err = run(capsys, "simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                       "--offload", "all", f"{flag}={value}")
    assert_one_line_exit_2(code, err, f"argument {flag}")


def test_offload_copy_time_may_not_overflow(capsys):
    code, _, err = run(capsys, "simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                       "--offload", "all", "--act-bytes", "1e12", "--offload-bandwidth", "1e-12")
    assert_one_line_exit_2(code, err, "--act-bytes", "--offload-bandwidth", "1e+24")


def test_search_time_limit_is_bounded(capsys):
    for value in ("nan", "0", "1e9"):
        code, _, err = run(capsys, "search", "--pp", "2", "-m", "4", "--memory-limit", "4",
                           "--time-limit", value)
        assert_one_line_exit_2(code, err, "argument --time-limit", "86400")


@pytest.mark.parametrize(("flag", "text", "needle"), [
    ("--cost", "f=1,f=2", "--cost gives f twice"),
    ("--cost", "f=1,b=2, f =3", "--cost gives f twice"),
    ("--mem", "b=1,b=2", "--mem gives b twice"),
    ("--cost", "f=nan", "--cost f=nan"),
    ("--cost", "w=inf", "--cost w=inf"),
    ("--cost", "ar=1e13", "--cost ar=1e13"),
    ("--mem", "b=inf", "--mem b=inf"),
    ("--mem", "w=nan", "--mem w=nan"),
])
def test_cost_and_memory_keys_are_given_once_and_finite(capsys, flag, text, needle):
    code, _, err = run(capsys, "simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                       flag, text)
    assert_one_line_exit_2(code, err, needle)


@pytest.mark.parametrize("command", [
    ["simulate", "--schedule", "stp"], ["draw", "--schedule", "stp", "--out", "x.svg"],
    ["search", "--memory-limit", "8"], ["compare"],
])
def test_costs_whose_sums_overflow_are_refused(capsys, command):
    code, out, err = run(capsys, *command, "--pp", "4", "-m", "8", "--cost",
                         "f=1e308,b=1e308,w=1e308")
    assert_one_line_exit_2(code, err, "--cost f=1e308", "1e+12")
    assert "inf" not in out and "nan" not in out


def test_the_largest_costs_give_finite_results(capsys):
    code, out, _ = run(capsys, "simulate", "--schedule", "stp", "--pp", "4", "-m", "8",
                       "--cost", "f=1e12,b=1e12,w=1e12,ar=1e12,comm=1e12", "--json")
    obj = json.loads(out)
    assert code == 0 and 0 < obj["makespan"] < float("inf")
    assert 0 <= obj["bubble_rate"] < 1


def test_compare_names_each_schedule_once(capsys):
    code, _, err = run(capsys, "compare", "--pp", "2", "-m", "4", "--schedules", "stp,1f1b,stp")
    assert_one_line_exit_2(code, err, "--schedules names stp twice")


def test_refusals_leave_no_file_behind(capsys, tmp_path):
    out = tmp_path / "x.svg"
    code, _, _ = run(capsys, "draw", "--schedule", "stp", "--pp", "100000", "-m", "4",
                     "--out", str(out))
    assert code == 2 and not Path(out).exists()
