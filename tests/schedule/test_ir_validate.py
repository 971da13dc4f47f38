"""IR text form and validator errors (hand-built schedules)."""

import pytest

from stp.schedule.io import from_rows, parse_action
from stp.schedule.ir import Block, Done, Kind, Pass, Schedule, v_placement
from stp.schedule.memory import MemCosts, peak_by_order
from stp.schedule.validate import ScheduleError, validate

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


@pytest.mark.parametrize(
    "text", ["0F3", "2I1", "2W1", "1B0", "(0F7;7I3)OVERLAP_F_B", "(0F1;5W0;6W2)OVERLAP_F_B"]
)
def test_text_round_trip(text):
    assert str(parse_action(text)) == text


@pytest.mark.parametrize("text", ["0X3", "F3", "(0F1)OVERLAP_F_B", "(7I3;0F7)OVERLAP_F_B", ""])
def test_bad_action_text(text):
    with pytest.raises(ValueError):
        parse_action(text)


def test_block_kinds():
    with pytest.raises(ValueError, match="accepted are"):
        Block((Pass(0, F, 0), Pass(1, B, 0), Pass(1, W, 0)))


def two_rank(r0, r1, m=1):
    return Schedule("t", 2, m, (0, 1), (tuple(r0), tuple(r1)))


def test_valid_simple():
    validate(two_rank([Pass(0, F, 0), Pass(0, BW, 0)], [Pass(1, F, 0), Pass(1, BW, 0)]))


def test_missing_pass_names_it():
    with pytest.raises(ScheduleError, match=r"W\(stage 1, mb 0\) never runs on rank 1"):
        validate(two_rank([Pass(0, F, 0), Pass(0, BW, 0)], [Pass(1, F, 0), Pass(1, B, 0)]))


def test_duplicate_pass():
    with pytest.raises(ScheduleError, match="rank 0, position 1"):
        validate(two_rank([Pass(0, F, 0), Pass(0, F, 0), Pass(0, BW, 0)],
                          [Pass(1, F, 0), Pass(1, BW, 0)]))


def test_wrong_rank():
    with pytest.raises(ScheduleError, match="stage 1 is placed on rank 1"):
        validate(two_rank([Pass(0, F, 0), Pass(1, F, 0), Pass(0, BW, 0)],
                          [Pass(1, BW, 0)]))


def test_mb_out_of_range():
    with pytest.raises(ScheduleError, match="microbatch 3 outside 0..0"):
        validate(two_rank([Pass(0, F, 3)], [Pass(1, F, 0)]))


def test_backward_before_own_forward():
    with pytest.raises(ScheduleError, match=r"rank 1, position 0 \(1B0\).*only later"):
        validate(two_rank([Pass(0, F, 0), Pass(0, BW, 0)], [Pass(1, BW, 0), Pass(1, F, 0)]))


def test_w_before_b():
    with pytest.raises(ScheduleError, match=r"rank 1, position 1 \(1W0\)"):
        validate(two_rank([Pass(0, F, 0), Pass(0, BW, 0)],
                          [Pass(1, F, 0), Pass(1, W, 0), Pass(1, B, 0)]))


def test_cross_rank_deadlock_is_diagnosed():
    # rank 0 waits for B(1,0) while rank 1 waits for F(0,1), which rank 0 runs later
    r0 = [Pass(0, F, 0), Pass(0, BW, 0), Pass(0, F, 1), Pass(0, BW, 1)]
    r1 = [Pass(1, F, 0), Pass(1, F, 1), Pass(1, BW, 0), Pass(1, BW, 1)]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 position 1 .* rank 1 position 1"):
        validate(two_rank(r0, r1, m=2))


def test_block_with_dependent_passes_rejected():
    sch = Schedule("t", 1, 1, (0, 0),
                   ((Block((Pass(0, F, 0), Pass(1, F, 0))), Pass(1, BW, 0), Pass(0, BW, 0)),))
    with pytest.raises(ScheduleError, match="inside the same braided block"):
        validate(sch)


def test_memory_limit_names_position():
    r0 = [Pass(0, F, 0), Pass(0, F, 1), Pass(0, BW, 0), Pass(0, BW, 1)]
    r1 = [Pass(1, F, 0), Pass(1, BW, 0), Pass(1, F, 1), Pass(1, BW, 1)]
    sch = two_rank(r0, r1, m=2)
    validate(sch, memory_limit=2)
    assert peak_by_order(sch) == [2.0, 1.0]
    with pytest.raises(ScheduleError, match=r"rank 0, position 1 \(0F1\).*exceeds the limit 1.5"):
        validate(sch, memory_limit=1.5)


def test_v_placement_chunk_index():
    sch = Schedule("t", 2, 1, v_placement(2), ((), ()))
    assert [sch.chunk_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert sch.stages_of(0) == (0, 3)


def test_from_rows_infers_placement_and_rejects_stage_on_two_ranks():
    sch = from_rows([["0F0", "0B0"], ["1F0", "1B0"]])
    assert sch.stage_to_rank == (0, 1) and sch.num_microbatches == 1
    with pytest.raises(ValueError, match="row 1 .* cell 0: stage 0"):
        from_rows([["0F0"], ["0B0"]])


def test_mem_costs_in_memory_model():
    sch = Schedule("t", 1, 1, (0,), ((Pass(0, F, 0), Pass(0, B, 0), Pass(0, W, 0)),))
    assert peak_by_order(sch, MemCosts(2.0, 0.5)) == [2.0]


def test_pass_provides_and_completes_its_results():
    assert Pass(2, F, 5).provides() == (F,)
    assert Pass(2, B, 5).provides() == (B,)
    assert Pass(2, W, 5).provides() == (W,)
    assert Pass(2, BW, 5).provides() == (B, W)  # a full backward completes both halves
    assert Pass(2, BW, 5).completes() == (Done(2, B, 5), Done(2, W, 5))
    assert str(Done(1, B, 0)) == "B(stage 1, mb 0)"


def test_pass_needs_follow_the_pipeline_dependencies():
    assert Pass(0, F, 3).needs(4) == ()
    assert Pass(2, F, 3).needs(4) == (Done(1, F, 3),)
    assert Pass(3, B, 3).needs(4) == (Done(3, F, 3),)  # the last stage starts the backward
    assert Pass(1, BW, 3).needs(4) == (Done(1, F, 3), Done(2, B, 3))
    assert Pass(1, W, 3).needs(4) == (Done(1, B, 3),)
    # a BW satisfies what a W or a later B waits for
    done = set(Pass(2, BW, 3).completes())
    assert all(d in done for d in Pass(2, W, 3).needs(4) + Pass(1, B, 3).needs(4)[1:])


def test_json_of_older_files_with_offload_chunk_still_reads():
    """Files written while the IR carried offload_chunk (always 0) still load;
    another value asked for an offload stp no longer does and is refused."""
    import json

    from stp.schedule import generate, io

    s = generate("stp", 2, 4)
    assert "offload_chunk" not in json.loads(io.dump_json(s))
    old = json.loads(io.dump_json(s)) | {"offload_chunk": 0}
    assert io.parse_json(json.dumps(old)) == s
    for bad in (1, True, "0"):
        with pytest.raises(ValueError, match=r"offload_chunk=.*moves chunk 0 only; drop the key"):
            io.parse_json(json.dumps(old | {"offload_chunk": bad}))
