"""The peer benchmark's tables (stp.bench.peer_table): a side that did not run says
why in its row instead of figures, and a whole failed setting still has its rows."""

import pytest

pytest.importorskip("torch.distributed.pipelining")

from stp.bench.peer import CSV_COMPILED, STP_COMPILE_MISSING, PeerSpec  # noqa: E402
from stp.bench.peer_table import failed_setting, format_tables  # noqa: E402
from stp.models import ModelConfig  # noqa: E402

MODEL = ModelConfig(hidden=32, num_layers=4, num_heads=4, num_kv_heads=4, max_seq_len=16)


def _ran(times: list[float]) -> dict:
    return {"times": times, "cpu": [[(t, 0), (t, 0)] for t in times]}


def _result(tp: int, compiled: bool) -> dict:
    spec = PeerSpec(schedules=("1f1b", "zb-v"), tp=tp, compile=compiled, model=MODEL,
                    seq_len=16, pairs=2)
    refused = "The ScheduleZBVZeroBubble schedule is not supported with compiled stages"
    rows = []
    for name in spec.schedules:
        stp, torch = _ran([0.2, 0.4]), _ran([0.4, 0.5])
        row = {"schedule": name, "first_s": {"torch": 3.0}, "first_loss": {"torch": 5.5},
               "times": {"torch": torch["times"]}, "cpu": {"torch": torch["cpu"]},
               "missing": {"stp": STP_COMPILE_MISSING, "torch-csv": CSV_COMPILED}}
        if name == "zb-v":
            row |= {"times": {"stp": stp["times"]}, "cpu": {"stp": stp["cpu"]},
                    "first_s": {"stp": 1.0}, "first_loss": {"stp": 5.5},
                    "missing": {"torch": refused, "torch-csv": CSV_COMPILED}}
        rows.append(row)
    return {"spec": spec, "rows": rows}


def test_a_side_that_did_not_run_says_why_in_its_row():
    lines = format_tables([_result(2, True)]).splitlines()
    one = next(line for line in lines if line.startswith("| tp2 compiled | 1f1b |"))
    assert f"not run: {STP_COMPILE_MISSING}" in one
    assert "| 450.0 | - |" in one  # torch's median of 0.4 and 0.5 s; no ratio without stp
    zbv = next(line for line in lines if line.startswith("| tp2 compiled | zb-v |"))
    assert "not run: The ScheduleZBVZeroBubble schedule is not supported" in zbv
    assert "| 300.0 |" in zbv  # stp's median of 0.2 and 0.4 s


def test_a_failed_setting_keeps_a_row_per_schedule():
    spec = PeerSpec(schedules=("1f1b", "zb-v"), tp=2, model=MODEL, seq_len=16)
    text = format_tables([failed_setting(spec, "run failed: rank 3 exited")])
    rows = [line for line in text.splitlines() if line.startswith("| tp2 eager |")]
    assert len(rows) == 2 and all("not run: run failed: rank 3 exited" in r for r in rows)


def test_a_failure_is_one_line_naming_its_root_cause():
    from stp.bench.peer import error_line

    try:
        try:
            raise AttributeError("'Tensor' object has no attribute '_local_tensor'")
        except AttributeError as inner:
            raise RuntimeError("\n   Failed to run stage backward:\n  Stage output: ...") from inner
    except RuntimeError as e:
        line = error_line(e)
    assert line == ("Failed to run stage backward: AttributeError: 'Tensor' object has no "
                    "attribute '_local_tensor'")
    assert len(error_line(ValueError("x" * 1000))) == 240
