"""The helpers every generator ends with: dropping the microbatches a rule was
built past, and the schedule on its placement with `chunks` first in its meta."""

from stp.schedule.ir import Block, Kind, Pass, drop_microbatches, looped_schedule, v_schedule


def test_drop_microbatches_keeps_order_and_unbraids_a_lone_survivor():
    actions = [Pass(0, Kind.F, 0), Pass(0, Kind.F, 2), Block((Pass(1, Kind.F, 1),
               Pass(0, Kind.B, 3))), Block((Pass(1, Kind.F, 3), Pass(0, Kind.W, 2))),
               Block((Pass(1, Kind.F, 0), Pass(0, Kind.B, 1)))]
    assert drop_microbatches(actions, 2) == (
        Pass(0, Kind.F, 0), Pass(1, Kind.F, 1), Block((Pass(1, Kind.F, 0), Pass(0, Kind.B, 1))))


def test_placed_schedules_put_chunks_first_and_the_rest_in_order():
    rows = [[Pass(0, Kind.F, 0)], [Pass(1, Kind.F, 0)]]
    looped = looped_schedule("x", 1, 2, rows + [], b=1, a=2)
    assert looped.stage_to_rank == (0, 1, 0, 1) and looped.num_ranks == 2
    assert list(looped.meta.items()) == [("chunks", 2), ("b", 1), ("a", 2)]
    v = v_schedule("y", 3, rows, placement="v")
    assert v.stage_to_rank == (0, 1, 1, 0) and v.num_microbatches == 3
    assert list(v.meta.items()) == [("chunks", 2), ("placement", "v")]
