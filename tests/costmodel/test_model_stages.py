"""Per-stage costs from a model (the output layer on the last stage) and from a
measured trace; `--partition`, `--stage-costs`, `--costs-from` and `stp costs`."""

from __future__ import annotations

import json

import pytest

from stp.cli.main import main
from stp.costmodel import derive, parse_hardware, parse_model
from stp.costmodel.measured import measured_stage_costs
from stp.costmodel.stages import edge_costs, head_flops, layered_costs
from stp.schedule import generate
from stp.schedule.registry import SCHEDULES
from stp.sim import simulate
from stp.sim.layered import LayeredCosts
from stp.sim.stages import StageCost
from stp.sim.trace_format import trace_events

HW = parse_hardware("a100-80g")
PP, M = 4, 12


def _simulate_json(capsys, *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_large_vocabulary_lengthens_every_schedule_by_the_output_layers_flops(capsys):
    """The output layer (F, B and W: 2 s b h V FLOPs each, `head_flops`) runs on
    the last stage once per microbatch: the step grows by m times its time,
    less what the last stage's rank had idle before (it may absorb some)."""
    small, large = parse_model("zb-1.5b,vocab=1000"), parse_model("zb-1.5b,vocab=256000")
    per_mb = 3 * (head_flops(large) - head_flops(small)) / HW.achieved_flops * 1e3  # ms
    assert head_flops(large) == 2 * 1024 * 6 * 2304 * 256000
    for name in SCHEDULES:
        argv = ["--schedule", name, "--pp", str(PP), "-m", str(M)]
        lo = _simulate_json(capsys, *argv, "--model", "zb-1.5b,vocab=1000")
        hi = _simulate_json(capsys, *argv, "--model", "zb-1.5b,vocab=256000")
        grown = hi["makespan"] - lo["makespan"]
        last = generate(name, PP, M).stage_to_rank[-1]
        slack = lo["makespan"] - lo["ranks"][last]["compute"]  # the last stage's rank idle
        assert grown > 0, name
        assert M * per_mb - slack - 1e-6 <= grown <= 1.05 * M * per_mb, (name, grown, per_mb)
        assert grown >= 0.75 * M * per_mb, name


def test_the_output_layer_is_on_the_last_stage_and_the_embedding_on_the_first():
    model = parse_model("qwen2-12.1b,tp=4")
    embed, head = edge_costs(model, HW, 2)
    ms = 1e3 / HW.achieved_flops
    assert head.f == head.b == head.w == pytest.approx(head_flops(model) * ms)
    assert embed.f == embed.b == embed.w == 0 and embed.ar > 0 and embed.ar_b == 0
    assert head.ar_b > head.ar > 0  # the input gradient's all-reduce is the large one
    unit = derive(model, HW, 2).bytes_per_unit
    s, b, v = model.sequence, model.micro_batch, model.vocab
    assert head.mem_b * unit >= 4 * s * b * v / 4  # the fp32 softmax of V/t logits
    d = derive(model, HW, 2)
    table = layered_costs(model, HW, 2, d.costs, d.mem).table((10, 9, 9, 10))
    assert table.stages[0].f == pytest.approx(10 * table.stages[1].f / 9)
    assert table.stages[3].f == pytest.approx(10 * table.stages[1].f / 9 + head.f)


def test_partition_auto_on_the_cli_is_never_slower_and_prints_the_partition(capsys):
    argv = ["--schedule", "1f1b", "--pp", "4", "-m", "8", "--model", "zb-1.5b,vocab=256000"]
    even = _simulate_json(capsys, *argv)
    auto = _simulate_json(capsys, *argv, "--partition", "auto")
    assert even["partition"] == [6, 6, 5, 5]
    assert sum(auto["partition"]) == 22 and auto["partition"][-1] < 5
    assert auto["makespan"] < 0.9 * even["makespan"]
    assert auto["even_makespan"] == pytest.approx(even["makespan"])
    assert main(["simulate", *argv, "--partition", "auto"]) == 0
    assert "partition " in capsys.readouterr().out
    given = _simulate_json(capsys, *argv, "--partition", ",".join(map(str, auto["partition"])))
    assert given["makespan"] == pytest.approx(auto["makespan"])


@pytest.mark.parametrize("argv, needle", [
    (["--partition", "6,6,6,6"], "--partition 6,6,6,6 sums to 24 layers but the model has 22"),
    (["--partition", "11,0,6,5"], "stage 1 has 0 layers"),
    (["--partition", "11,11"], "names 2 stages but the schedule has 4 global stages"),
    (["--partition", "1,x"], "give auto or layer counts"),
    (["--model", "zb-1.5b,layers=3"], "pp=4 exceeds the model's 3 layers"),
])
def test_bad_partitions_are_refused_in_one_line(capsys, argv, needle):
    base = ["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8"]
    if "--model" not in argv:
        base += ["--model", "zb-1.5b"]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_auto_needs_a_model_and_a_table_excludes_the_cost_flags(capsys, tmp_path):
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                 "--partition", "auto"]) == 2
    assert "--partition auto needs --model" in capsys.readouterr().err
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"stages": [{"f": 1, "b": 1, "w": 1}] * 2}))
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4", "--stage-costs",
                 str(path), "--cost", "f=2"]) == 2
    assert "drop --cost" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "zb-v", "--pp", "2", "-m", "4", "--stage-costs",
                 str(path)]) == 2
    assert "has 2 stages but the schedule has 4 global stages" in capsys.readouterr().err
    got = _simulate_json(capsys, "--schedule", "1f1b", "--pp", "2", "-m", "4",
                         "--stage-costs", str(path))
    assert got["makespan"] == pytest.approx(simulate(generate("1f1b", 2, 4)).makespan)


def _measured_doc(res, m: int, partition: list[int]) -> dict:
    sch = res.schedule
    names = {(r, i): str(a) for r, acts in enumerate(sch.actions) for i, a in enumerate(acts)}
    return {"traceEvents": trace_events(res.spans, action_names=names, time_scale=1e3),
            "otherData": {"source": "stp runtime (measured)", "microbatches": m,
                          "pp": sch.num_ranks, "partition": partition}}


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v"])
def test_measured_costs_recover_the_costs_a_timeline_was_made_with(name):
    """A simulated timeline written as a runtime trace: `stp costs` reads back
    each stage's costs and the send latency, and they simulate the same step."""
    sch = generate(name, 2, 6)
    model = LayeredCosts(StageCost(1.0, 1.5, 0.5, mem_b=0.5), last=StageCost(2, 2, 2),
                         comm=0.25)
    counts = (2,) * sch.num_stages
    res = simulate(sch, stages=model.table(counts))
    got = measured_stage_costs(_measured_doc(res, 6, list(counts)))
    for want, have in zip(model.table(counts).stages, got.stages, strict=True):
        assert (have.f, have.b, have.w) == pytest.approx((want.f, want.b, want.w), rel=1e-6)
    assert got.comm == pytest.approx(0.25, rel=1e-6)
    again = simulate(sch, stages=got)
    assert again.makespan == pytest.approx(res.makespan, rel=1e-6)


def test_stp_costs_and_costs_from_on_the_cli(capsys, tmp_path):
    sch = generate("1f1b", 2, 4)
    res = simulate(sch, stages=LayeredCosts(StageCost(1, 1, 1)).table((1, 1)))
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps(_measured_doc(res, 4, [1, 1])))
    out = tmp_path / "stages.json"
    assert main(["costs", str(trace), "--out", str(out)]) == 0
    assert "2 global stages" in capsys.readouterr().out
    table = json.loads(out.read_text())
    assert [s["f"] for s in table["stages"]] == pytest.approx([1, 1])
    for flag, path in (("--costs-from", trace), ("--stage-costs", out)):
        got = _simulate_json(capsys, "--schedule", "1f1b", "--pp", "2", "-m", "4", flag,
                             str(path))
        assert got["makespan"] == pytest.approx(res.makespan)
    (tmp_path / "plain.json").write_text(json.dumps({"traceEvents": []}))
    assert main(["costs", str(tmp_path / "plain.json")]) == 2
    assert "not a measured trace" in capsys.readouterr().err


def test_search_and_compare_and_draw_take_partitions(capsys, tmp_path):
    model = ["--model", "zb-1.5b,vocab=256000"]
    assert main(["compare", "--pp", "4", "-m", "8", *model, "--partition", "auto",
                 "--schedules", "1f1b,zb-v", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {len(r["partition"]) for r in rows} == {4, 8}
    assert main(["search", "--pp", "4", "-m", "8", *model, "--partition", "auto",
                 "--memory-limit", "8", "--time-limit", "2", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert sum(found["partition"]) == 22
    assert max(found["peak_activation"]) <= 8 + 1e-9
    svg = tmp_path / "t.svg"
    assert main(["draw", "--schedule", "zb-v", "--pp", "4", "-m", "8", *model,
                 "--partition", "auto", "--out", str(svg)]) == 0
    assert "per-stage costs" in svg.read_text()


def test_measured_costs_read_the_all_to_alls_apart_from_the_all_reduces():
    """A2A spans (expert parallelism) of a trace become each stage's `a2a`, not its
    all-reduce."""
    sch = generate("1f1b", 2, 6)
    model = LayeredCosts(StageCost(1.0, 1.5, 0.5, ar=0.2, mem_b=0.5, a2a=0.3), comm=0.25)
    counts = (2,) * sch.num_stages
    res = simulate(sch, stages=model.table(counts))
    got = measured_stage_costs(_measured_doc(res, 6, list(counts)))
    for want, have in zip(model.table(counts).stages, got.stages, strict=True):
        assert (have.ar, have.a2a) == pytest.approx((want.ar, want.a2a), rel=1e-6)
