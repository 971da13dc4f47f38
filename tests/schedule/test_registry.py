"""The schedule registry: lookup, generate, and make (generate + validate)."""

import pytest

from stp.schedule import SCHEDULES, generate, make, names, validate


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_make_defaults_to_two_microbatches_per_rank_and_validates(name: str) -> None:
    for p in (1, 2, 4):
        s = make(name, p)
        assert (s.name, s.num_ranks, s.num_microbatches) == (name, p, 2 * p)
        validate(s)
        assert make(name, p, 3).num_microbatches == 3
        assert make(name, p, 3) == generate(name, p, 3)


def test_every_schedule_accepts_a_single_microbatch() -> None:
    for name in names():
        assert make(name, 4, 1).num_microbatches == 1


@pytest.mark.parametrize("m", [0, -2, 2.0])
def test_make_refuses_a_bad_microbatch_count(m) -> None:
    with pytest.raises(ValueError, match=rf"stp: {m!r} microbatches not accepted at pp=4; "
                                         "it needs at least 1"):
        make("stp", 4, m)


def test_make_refuses_a_bad_pipeline_size_or_name() -> None:
    with pytest.raises(ValueError, match="pipeline size 0 not accepted"):
        make("1f1b", 0)
    with pytest.raises(ValueError, match="unknown schedule 'nope'; choose one of: gpipe"):
        make("nope", 2)
