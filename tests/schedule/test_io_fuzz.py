"""Fuzzing the schedule readers: any input either parses to a schedule the
validator accepts, or is refused with a one-line ValueError (through the CLI:
exit 2, one line on stderr); never another exception, and within a bound on
time and memory."""

from __future__ import annotations

import contextlib
import io as stdio
import json
import resource
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stp.cli.main import main
from stp.schedule import Schedule, generate, io, validate

SECONDS = 5.0
"""Most one input may take (each takes milliseconds; room for a loaded machine)."""
HEADROOM_BYTES = 1 << 30
"""Address space the readers may add to the test process: the faults fixed by
the limits allocated 4 GB for a 100-byte input."""

FUZZ = settings(max_examples=200, deadline=SECONDS * 1000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def bounded_memory() -> Iterator[None]:
    """Cap this process's address space while the fuzz runs (Linux), so an
    input that allocates by its indices fails with MemoryError, not the machine."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        yield  # no /proc: run without the cap
        return
    size_kb = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("VmSize:")))
    old = resource.getrlimit(resource.RLIMIT_AS)
    cap = size_kb * 1024 + HEADROOM_BYTES
    if old[1] != resource.RLIM_INFINITY:
        cap = min(cap, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


# -- inputs ----------------------------------------------------------------------

# small indices make schedules that parse; the limits' edges and huge ones, refusals
_INDEX = st.one_of(st.integers(0, 5), st.sampled_from([1023, 1024, 4095, 4096, 10**8, 10**15]),
                   st.integers(0, 10**15))
_KIND = st.sampled_from("FIWBX")


@st.composite
def _pass_text(draw: st.DrawFn) -> str:
    return f"{draw(_INDEX)}{draw(_KIND)}{draw(_INDEX)}"


@st.composite
def _block_text(draw: st.DrawFn) -> str:
    passes = draw(st.lists(_pass_text(), min_size=1, max_size=3))
    return "(" + ";".join(passes) + ")OVERLAP_F_B"


_CSV_TOKENS = ["0", "1", "7", "F", "I", "W", "B", ",", ";", "(", ")", "\n", "\r\n", " ", '"',
               "\x00", "\ufeff", "\uff10", "\u0660", "OVERLAP_F_B", "SEND_F", "99999999999", "{"]
_cell = st.one_of(_pass_text(), _block_text(), st.just(""),
                  st.lists(st.sampled_from(_CSV_TOKENS), max_size=6).map("".join))


def _mutated(text: Callable[[Schedule], str]) -> st.SearchStrategy[str]:
    """A real schedule's text with up to three spans replaced by tokens."""
    base = st.builds(generate, st.sampled_from(["1f1b", "zb-v", "stp", "zb-h1"]),
                     st.integers(1, 3), st.integers(1, 4)).map(text)

    @st.composite
    def mutate(draw: st.DrawFn) -> str:
        s = draw(base)
        for _ in range(draw(st.integers(0, 3))):  # 0: the valid text itself
            i = draw(st.integers(0, len(s)))
            j = draw(st.integers(i, min(len(s), i + 6)))
            s = s[:i] + draw(st.sampled_from(_CSV_TOKENS + ['"x"', "[", "]", ":", "1e999"])) + s[j:]
        return s

    return mutate()


# forwards pass the per-cell order checks, so their indices reach the whole-row checks
_forwards = st.lists(st.builds("{}F{}".format, _INDEX, _INDEX), min_size=1, max_size=4)

csv_texts = st.one_of(
    _forwards.map(",".join),
    st.lists(st.lists(_cell, max_size=8), min_size=1, max_size=4).map(
        lambda rows: "\n".join(",".join(r) for r in rows)),
    st.lists(st.sampled_from(_CSV_TOKENS), max_size=40).map("".join),
    _mutated(io.dump_csv),
)

_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), _INDEX, st.floats(), st.text(max_size=5),
              _pass_text(), _block_text()),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12,
)
_FIELDS = ["format", "version", "name", "num_ranks", "num_microbatches", "stage_to_rank",
           "actions", "meta", "offload_chunk"]


@st.composite
def _json_patched(draw: st.DrawFn) -> str:
    """A valid JSON schedule with one field replaced by any JSON value."""
    obj = json.loads(io.dump_json(generate("zb-v", 2, draw(st.integers(1, 4)))))
    obj[draw(st.sampled_from(_FIELDS))] = draw(_json_values)
    return json.dumps(obj)


json_texts = st.one_of(
    _json_patched(),
    _json_values.map(json.dumps),
    st.lists(st.sampled_from(list('[]{}",:0123456789 ') + ["NaN", "-Infinity", "[" * 40,
                                                              '"format"', '"stp-schedule"']),
             max_size=30).map("".join),
    _mutated(io.dump_json),
    st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n),  # past the interpreter's stack
    st.integers(1, 5_000).map(lambda n: '{"a": ' * n + "1" + "}" * n),
)


# -- properties ----------------------------------------------------------------


def _judged(read: Callable[[str], Schedule], text: str) -> None:
    start = time.perf_counter()
    try:
        sch = read(text)
    except ValueError as e:
        event("refused")
        assert str(e) and "\n" not in str(e), repr(str(e))
    else:
        event("parsed")
        validate(sch)  # what the reader returns, the validator accepts
    assert time.perf_counter() - start < SECONDS


@FUZZ
@given(text=csv_texts)
def test_csv_reader_parses_or_refuses(text):
    _judged(io.parse_csv, text)


@FUZZ
@given(text=json_texts)
def test_json_reader_parses_or_refuses(text):
    _judged(io.parse_json, text)


def _cli(*argv: str) -> tuple[int, str]:
    err = stdio.StringIO()
    with contextlib.redirect_stdout(stdio.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


@settings(FUZZ, max_examples=100)
@given(text=st.one_of(csv_texts.map(lambda t: ("csv", t)), json_texts.map(lambda t: ("json", t))))
def test_cli_reads_any_file_with_exit_0_or_one_line_and_exit_2(text):
    suffix, body = text
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"s.{suffix}"
        path.write_text(body, encoding="utf-8", errors="surrogatepass")
        start = time.perf_counter()
        code, err = _cli("simulate", f"--from-{suffix}", str(path), "--json")
        assert time.perf_counter() - start < SECONDS
    if code == 2:
        assert err.startswith("stp: error: ") and err.count("\n") == 1, err
    else:
        assert code == 0, err
