"""Per-stage costs in the simulator: the uniform shorthand as a table, uneven
stages, the file format, layer partitions and `--partition auto`."""

from __future__ import annotations

import json

import pytest

from stp.schedule import generate
from stp.schedule.offload import STP_CHUNK, plan_chunks
from stp.search.partition import auto_partition, balanced_partition
from stp.sim import Costs, MemCosts, OffloadCosts, simulate
from stp.sim.layered import LayeredCosts, check_partition, even_partition, parse_partition
from stp.sim.stages import StageCost, StageCosts, load_stage_costs

COSTS = Costs(f=2, b=2.5, w=1.5, ar=0.4, comm=0.1)
MEM = MemCosts(m_b=1, m_w=0.3)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "stp", "1f1b-interleaved"])
@pytest.mark.parametrize("layers", [1, 2])
def test_the_uniform_table_simulates_as_the_shorthand(name, layers):
    sch = generate(name, 4, 10)
    plain = simulate(sch, COSTS, MEM, layers)
    table = StageCosts.uniform(COSTS, MEM, sch.num_stages, sch.chunks, layers)
    staged = simulate(sch, COSTS, MEM, layers, stages=table)
    assert staged.makespan == pytest.approx(plain.makespan, rel=1e-12)
    assert staged.peak_activation == pytest.approx(plain.peak_activation, rel=1e-12)
    for a, b in zip(staged.ranks, plain.ranks, strict=True):
        assert (a.compute, a.exposed_tp, a.idle) == pytest.approx(
            (b.compute, b.exposed_tp, b.idle), rel=1e-9, abs=1e-9)


def test_offload_under_a_uniform_table_matches_the_shorthand():
    sch = generate("stp", 4, 12)
    plan = plan_chunks(sch, {STP_CHUNK}, policy="stp")
    oc = OffloadCosts(bandwidth=0.5)
    plain = simulate(sch, COSTS, MEM, offload=plan, offload_costs=oc)
    table = StageCosts.uniform(COSTS, MEM, sch.num_stages, sch.chunks)
    staged = simulate(sch, COSTS, MEM, offload=plan, offload_costs=oc, stages=table)
    assert staged.makespan == pytest.approx(plain.makespan, rel=1e-12)
    assert staged.peak_activation == pytest.approx(plain.peak_activation, rel=1e-12)


def test_a_heavier_last_stage_is_the_bottleneck_of_1f1b():
    p, m, extra = 4, 16, 1.5
    sch = generate("1f1b", p, m)
    base = StageCosts.uniform(Costs(1, 1, 1), MemCosts(), p, 1)
    stages = list(base.stages)
    stages[-1] = StageCost(1 + extra, 1, 1, mem_b=1)
    heavy = simulate(sch, stages=StageCosts(tuple(stages)))
    plain = simulate(sch, stages=base)
    # the last stage computes every microbatch back to back: m times the extra
    assert heavy.makespan - plain.makespan == pytest.approx(m * extra)
    assert heavy.ranks[-1].compute == pytest.approx(m * (3 + extra))


def test_per_stage_memory_and_all_reduce_are_the_stages_own():
    sch = generate("1f1b", 2, 4)
    table = StageCosts((StageCost(1, 1, 1, ar=0.2, ar_b=0.0, mem_b=3.0),
                        StageCost(1, 1, 1, ar=0.0, ar_b=0.6, mem_b=0.5)))
    res = simulate(sch, stages=table, record_spans=True)
    assert res.peak_activation == pytest.approx([2 * 3.0, 0.5])
    ar = {(s.rank, s.kind): 0.0 for s in res.spans if s.lane == "compute"}
    for s in res.spans:
        if s.lane == "tp":
            pass_kind = s.name[1]
            ar[(s.rank, pass_kind)] = ar.get((s.rank, pass_kind), 0.0) + s.duration
    assert ar[(0, "F")] == pytest.approx(4 * 0.2) and ar.get((0, "B"), 0.0) == 0.0
    assert ar[(1, "B")] == pytest.approx(4 * 0.6) and ar.get((1, "F"), 0.0) == 0.0
    assert res.to_json()["stage_costs"]["stages"][0]["mem_b"] == 3.0


def test_a_table_of_the_wrong_length_is_refused():
    sch = generate("zb-v", 2, 4)
    with pytest.raises(ValueError, match="has 2 stages but the schedule has 4 global stages"):
        simulate(sch, stages=StageCosts.uniform(Costs(), MemCosts(), 2, 1))


def test_the_file_format_round_trips_and_bad_files_name_the_problem(tmp_path):
    table = StageCosts((StageCost(1, 2, 3, 0.1, 0.2, 0.5, 0.1, 4), StageCost(2, 2, 2)),
                       comm=0.3, partition=(1, 2))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    assert load_stage_costs(path) == table
    bad = {
        '{"stages": [{"f": 1, "b": 1}]}': "w missing",
        '{"stages": [{"f": 1, "b": 1, "w": -1}]}': "accepted are finite numbers",
        '{"stages": [{"f": 1, "b": 1, "w": 1, "x": 2}]}': "unknown key 'x'",
        '{"stages": [{"f": 1, "b": 1, "w": 1, "mem_b": 1, "mem_w": -2}]}': "mem_w=-2",
        '{"stages": []}': "0 stages; give 1 to 1024",
        "[1, 2]": "expected an object",
        "{": "is not JSON",
    }
    for text, needle in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=needle) as got:
            load_stage_costs(path)
        assert "\n" not in str(got.value)


def test_partition_text_and_checks():
    assert parse_partition("auto") == "auto"
    assert parse_partition("1, 3,2") == (1, 3, 2)
    for text in ("1,a", "1.5,2", "", "-1,2", "\uff11,2"):
        with pytest.raises(ValueError, match="--partition"):
            parse_partition(text)
    assert check_partition((1, 3, 2), 3, 6) == (1, 3, 2)
    with pytest.raises(ValueError, match="sums to 6 layers but the model has 8"):
        check_partition((1, 3, 2), 3, 8)
    with pytest.raises(ValueError, match="stage 1 has 0 layers"):
        check_partition((3, 0, 3), 3, 6)
    with pytest.raises(ValueError, match="names 3 stages but the schedule has 4"):
        check_partition((1, 3, 2), 4, 6)


def _layered(head: float) -> LayeredCosts:
    return LayeredCosts(StageCost(1, 1, 1, mem_b=0.25), last=StageCost(head, head, head))


def test_layered_table_adds_the_edges_to_their_stages():
    model = LayeredCosts(StageCost(1, 2, 3, mem_b=0.5), first=StageCost(0, 0, 0, ar=0.3),
                         last=StageCost(4, 4, 4, mem_b=2), units=6)
    t = model.table((2, 1, 3))
    assert [s.f for s in t.stages] == [2, 1, 3 + 4]
    assert [s.mem_b for s in t.stages] == [1.0, 0.5, 1.5 + 2]
    assert t.stages[0].ar == 0.3 and {s.units for s in t.stages} == {6}
    assert t.partition == (2, 1, 3)


def test_balanced_partition_takes_layers_off_the_heavy_last_stage():
    assert balanced_partition(_layered(0), 12, 4) == (3, 3, 3, 3)
    counts = balanced_partition(_layered(2), 12, 4)  # the head costs two layers
    times = [3 * c for c in counts[:-1]] + [3 * counts[-1] + 6]
    assert max(times) == 12 and counts[-1] < 3  # 14 layers' work on 4 stages: 4 at most
    assert sum(balanced_partition(_layered(0.5), 13, 5)) == 13
    assert even_partition(10, 4) == (3, 3, 2, 2)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "stp"])
def test_auto_partition_is_never_slower_than_even_and_faster_with_a_heavy_head(name):
    sch = generate(name, 4, 8)
    layers = 3 * sch.num_stages
    light = auto_partition(sch, _layered(0.0), layers)
    assert light.result.makespan <= light.even.makespan + 1e-9
    heavy = auto_partition(sch, _layered(3.0), layers)
    assert heavy.result.makespan < 0.95 * heavy.even.makespan
    assert sum(heavy.counts) == layers and min(heavy.counts) >= 1


def test_auto_partition_keeps_the_memory_limit():
    sch = generate("1f1b", 4, 8)
    free = auto_partition(sch, _layered(3.0), 12)
    limit = max(free.result.peak_activation) - 0.1
    fitted = auto_partition(sch, _layered(3.0), 12, memory_limit=limit)
    assert max(fitted.result.peak_activation) <= limit + 1e-9
    assert fitted.result.makespan >= free.result.makespan
