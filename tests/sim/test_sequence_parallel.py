"""Sequence parallelism in the simulator: each F/B unit starts with an
all-gather and ends with a reduce-scatter (`stp.sim.engine`), and the cost
model charges ring all-gathers and reduce-scatters instead of all-reduces."""

import pytest

from stp.costmodel import parse_hardware, parse_model
from stp.costmodel.decoder.costs import derive_decoder
from stp.costmodel.hardware import allgather_time, allreduce_time, reduce_scatter_time
from stp.schedule import generate
from stp.sim import Costs, simulate


def _both(name: str, p: int, m: int, ar: float, layers: int = 1):
    sch = generate(name, p, m)
    with_ar = simulate(sch, Costs(f=2, b=2, w=2, ar=ar, comm=0.1), layers=layers,
                       record_spans=False)
    with_sp = simulate(sch, Costs(f=2, b=2, w=2, ag=ar / 2, rs=ar / 2, comm=0.1),
                       layers=layers, record_spans=False)
    return with_ar, with_sp


def test_lone_passes_pay_every_gather_and_scatter():
    """ZB-H1 at p=1, m=1 runs F, B, W alone: each of F and B waits for its
    leading all-gather, the reduce-scatter + all-gather between its units and
    its last reduce-scatter: f + b + w + 2 (ag + rs), the all-reduce's 2 ar."""
    sch = generate("zb-h1", 1, 1)
    res = simulate(sch, Costs(f=2, b=2, w=2, ag=0.3, rs=0.5), layers=2)
    assert res.makespan == pytest.approx(6 + 2 * 0.8)
    assert res.ranks[0].exposed_tp == pytest.approx(2 * 0.8)
    kinds = sorted({s.kind for s in res.spans if s.lane == "tp"})
    assert kinds == ["AG", "RS", "RS+AG"]


def test_full_backward_exposes_its_leading_gather_only():
    """1F1B at p=1, m=1: F then a full backward. With all-reduces every B
    all-reduce runs under its W; with SP the B's reduce-scatters and the
    gathers between its units do too, but the gather of the incoming gradient
    before its first unit has nothing to hide under: + ag / U."""
    ar, units = 0.4, 2
    with_ar, with_sp = _both("1f1b", 1, 1, ar)
    assert with_ar.makespan == pytest.approx(6 + ar)
    assert with_sp.makespan == pytest.approx(6 + ar + ar / 2 / units)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v", "1f1b-interleaved", "v-half"])
@pytest.mark.parametrize("ar", [0.4, 2.0])
def test_split_same_volume_is_never_slower(name: str, ar: float):
    """ag = rs = ar/2 (a ring all-reduce is one reduce-scatter and one
    all-gather): where the all-reduce was hidden, so is what replaces it, and
    a pass's first gather runs while its input was waiting."""
    for p, m in ((2, 8), (4, 12)):
        with_ar, with_sp = _both(name, p, m, ar, layers=2)
        assert with_sp.makespan <= with_ar.makespan + 1e-9


@pytest.mark.parametrize("ar", [0.4, 2.0])
def test_stp_pays_at_most_the_leading_gathers(ar: float):
    """STP braids F with B: only the gathers before a pass whose input arrives
    just in time can show; bounded by one ag/U per backward pass of a rank."""
    p, m, layers = 4, 12, 2
    with_ar, with_sp = _both("stp", p, m, ar, layers=layers)
    per_gather = ar / 2 / 2 / (2 * layers)  # ag of one chunk pass (v=2), one unit
    assert with_ar.makespan <= with_sp.makespan <= with_ar.makespan + 2 * m * per_gather


def test_ring_collectives_sum_to_an_all_reduce():
    n, t, bw, lat = 3e8, 8, 1.3e11, 5e-6
    assert allgather_time(n, t, bw, lat) == pytest.approx(7 * lat + 7 / 8 * n / bw)
    assert reduce_scatter_time(n, t, bw, lat) == allgather_time(n, t, bw, lat)
    assert (allgather_time(n, t, bw, lat) + reduce_scatter_time(n, t, bw, lat)
            == pytest.approx(allreduce_time(n, t, bw, lat)))
    assert allgather_time(n, 1, bw, lat) == 0.0


def test_cost_model_charges_gather_and_scatter_with_sp():
    hw = parse_hardware("a800-80g")
    plain = derive_decoder(parse_model("qwen2-12.1b,sequence=6144"), hw, 2).costs
    sp = derive_decoder(parse_model("qwen2-12.1b,sequence=6144,sequence_parallel=1"), hw,
                        2).costs
    assert plain.ag == plain.rs == 0 and plain.ar > 0
    assert sp.ar == 0 and sp.ag == sp.rs == pytest.approx(plain.ar / 2)
    assert sp.tp_time == pytest.approx(plain.tp_time)
    assert sp.comm < plain.comm  # the p2p message is s/t rows


@pytest.mark.parametrize("costs", [Costs(f=2, b=2, w=2, ar=0.4),
                                   Costs(f=2, b=2, w=2, ag=0.15, rs=0.25)])
def test_collective_time_is_exposed_plus_hidden(costs: Costs):
    """Each rank runs the F and the B of every microbatch through its share:
    2 m x (ar + ag + rs) of collectives, of which what the stream did not
    wait for ran hidden."""
    m = 8
    res = simulate(generate("stp", 2, m), costs, layers=2, record_spans=False)
    for r in res.ranks:
        assert r.tp_total == pytest.approx(2 * m * costs.tp_time)
        assert r.hidden_tp == pytest.approx(r.tp_total - r.exposed_tp)
        assert 0 < r.hidden_tp < r.tp_total


def test_a_stage_table_carries_the_collectives():
    """The uniform shorthand and its table give the same run; a table file
    names ag and rs per stage and reads back."""
    from stp.sim.stages import StageCosts

    costs = Costs(f=2, b=2, w=1, ag=0.2, rs=0.3, comm=0.1)
    sch = generate("zb-v", 2, 6)
    table = StageCosts.uniform(costs, simulate(sch, costs).mem, sch.num_stages, 2, layers=2)
    assert table.stages[0].ag == pytest.approx(0.1) and table.stages[0].rs == pytest.approx(0.15)
    assert StageCosts.from_json(table.to_json()) == table
    uniform = simulate(sch, costs, layers=2, record_spans=False)
    tabled = simulate(sch, costs, layers=2, record_spans=False, stages=table)
    assert tabled.makespan == pytest.approx(uniform.makespan)
    assert tabled.tp_bubble == pytest.approx(uniform.tp_bubble)


def test_cost_flag_takes_ag_and_rs(capsys):
    import json

    from stp.cli.main import main

    assert main(["simulate", "--schedule", "zb-h1", "--pp", "1", "-m", "1", "--cost",
                 "f=2,b=2,w=2,ag=0.3,rs=0.5", "--layers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan"] == pytest.approx(6 + 2 * 0.8)
    assert out["ranks"][0]["tp_total"] == pytest.approx(1.6)
    assert main(["simulate", "--schedule", "zb-h1", "--pp", "1", "-m", "1", "--cost",
                 "ag=0.3,ag=0.1"]) == 2
