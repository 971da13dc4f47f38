"""stp.schedule.validate: what tests/schedule/test_ir_validate.py leaves unchecked.

Written to kill mutants mutmut left alive in stp/schedule/validate.py
(docs/testing.md). The references are hand-built schedules and the dependency
rule of "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, section 2). Each
test names the bug it guards against.
"""

import pytest

from stp.schedule.ir import Block, Kind, Pass, Schedule
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


def test_a_deadlock_is_located_at_the_first_stuck_rank() -> None:
    """Kills: the location of the first stuck rank dropped (`first` starting from
    something other than None, so the error carries no rank or position). Rank 0
    waits for B(1, 0) while rank 1 waits for F(0, 1), which rank 0 runs later."""
    r0 = (Pass(0, F, 0), Pass(0, BW, 0), Pass(0, F, 1), Pass(0, BW, 1))
    r1 = (Pass(1, F, 0), Pass(1, F, 1), Pass(1, BW, 0), Pass(1, BW, 1))
    with pytest.raises(ScheduleError, match=r"^rank 0, position 1 \(0B0\): deadlock: ") as err:
        validate(Schedule("t", 2, 2, (0, 1), (r0, r1)))
    assert (err.value.rank, err.value.position, err.value.action) == (0, 1, Pass(0, BW, 0))


def _two(r0: tuple, r1: tuple, m: int = 1) -> Schedule:
    return Schedule("t", 2, m, (0, 1), (r0, r1))


_OK1 = (Pass(1, F, 0), Pass(1, BW, 0))
BAD = {
    "stage past the last": (
        _two((Pass(0, F, 0), Pass(2, F, 0), Pass(0, BW, 0)), _OK1),
        "rank 0, position 1 (2F0): stage 2 outside 0..1", (0, 1, Pass(2, F, 0))),
    "stage on another rank": (
        _two((Pass(0, F, 0), Pass(1, F, 0), Pass(0, BW, 0)), (Pass(1, BW, 0),)),
        "rank 0, position 1 (1F0): stage 1 is placed on rank 1, not on rank 0",
        (0, 1, Pass(1, F, 0))),
    "microbatch past the last": (
        _two((Pass(0, F, 0), Pass(0, F, 1), Pass(0, BW, 0)), _OK1),
        "rank 0, position 1 (0F1): microbatch 1 outside 0..0", (0, 1, Pass(0, F, 1))),
    "a pass twice": (
        _two((Pass(0, F, 0), Pass(0, F, 0), Pass(0, BW, 0)), _OK1),
        "rank 0, position 1 (0F0): F(stage 0, mb 0) already runs at rank 0, position 0",
        (0, 1, Pass(0, F, 0))),
    "a pass never run": (
        _two((Pass(0, F, 0), Pass(0, BW, 0)), (Pass(1, F, 0), Pass(1, B, 0))),
        "rank 1: W(stage 1, mb 0) never runs on rank 1", (1, None, None)),
    "dependent passes braided after a plain pass": (
        Schedule("t", 1, 1, (0, 0), ((Pass(0, F, 0), Block((Pass(1, F, 0), Pass(1, BW, 0))),
                                      Pass(0, BW, 0)),)),
        None, (0, 1, None)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_refusal_names_its_rank_position_and_action(case: str) -> None:
    """Kills: a location argument (rank, position, action) dropped or passed as None,
    the message's range bounds (0..S-1, 0..m-1) altered, `<=` for `<` in the stage and
    microbatch ranges, and the block check stopping at the first plain pass (`break`
    for `continue`)."""
    sch, message, (rank, position, action) = BAD[case]
    with pytest.raises(ScheduleError) as err:
        validate(sch)
    if message is not None:
        assert str(err.value) == message
    else:
        assert str(err.value).endswith("inside the same braided block; braided passes must be "
                                       "independent")
    assert (err.value.rank, err.value.position) == (rank, position)
    if action is not None:
        assert err.value.action == action
    elif rank == 0:
        assert err.value.action == Block((Pass(1, F, 0), Pass(1, BW, 0)))
