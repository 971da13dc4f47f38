"""stp.schedule.validate: what tests/schedule/test_ir_validate.py leaves unchecked.

Written to kill mutants mutmut left alive in stp/schedule/validate.py
(docs/testing.md). The references are hand-built schedules and the dependency
rule of "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, section 2). Each
test names the bug it guards against.
"""

import pytest

from stp.schedule.ir import Kind, Pass, Schedule
from stp.schedule.validate import ScheduleError, dependencies, validate

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def test_the_error_message_says_where_only_when_it_knows() -> None:
    """Kills: the location prefix started from something other than "" (None, text)
    and its ": " separator altered."""
    assert str(ScheduleError("broken")) == "broken"
    assert str(ScheduleError("broken", 1)) == "rank 1: broken"
    assert str(ScheduleError("broken", 0, 2)) == "rank 0, position 2: broken"
    err = ScheduleError("broken", 0, 1, Pass(0, F, 1))
    assert str(err) == "rank 0, position 1 (0F1): broken"
    assert (err.rank, err.position, err.action) == (0, 1, Pass(0, F, 1))


def test_dependencies_by_hand() -> None:
    """Kills: the pipeline depth not passed on (the last stage's backward waits for
    no later stage; the others wait for stage s+1's)."""
    assert dependencies(Pass(0, F, 2), 3) == []
    assert dependencies(Pass(1, F, 2), 3) == [(0, "F", 2)]
    assert dependencies(Pass(1, B, 2), 3) == [(1, "F", 2), (2, "B", 2)]
    assert dependencies(Pass(2, BW, 2), 3) == [(2, "F", 2)]
    assert dependencies(Pass(1, W, 0), 3) == [(1, "B", 0)]


def test_a_peak_within_the_tolerance_of_the_limit_is_accepted() -> None:
    """Kills: `cur >= limit + 1e-9` (a peak of exactly limit + 1e-9 refused). Peak 2
    activations on rank 0 (two forwards before their backwards)."""
    r0 = [Pass(0, F, 0), Pass(0, F, 1), Pass(0, BW, 0), Pass(0, BW, 1)]
    r1 = [Pass(1, F, 0), Pass(1, BW, 0), Pass(1, F, 1), Pass(1, BW, 1)]
    sch = Schedule("t", 2, 2, (0, 1), (tuple(r0), tuple(r1)))
    validate(sch, memory_limit=2.0 - 1e-9)
    with pytest.raises(ScheduleError, match="exceeds the limit"):
        validate(sch, memory_limit=2.0 - 1e-6)
