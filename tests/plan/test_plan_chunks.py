"""`stp plan` searches v chunks per rank: the bubble, the memory and the choice."""

import json

import pytest

from stp.cli.main import main
from stp.costmodel import HARDWARE
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.memory import Features, Layout, estimate_run
from stp.plan import PlanRequest, plan
from stp.plan.space import MAX_CHUNKS, chunk_options
from stp.schedule.ir import Kind, passes_of
from stp.schedule.registry import generate
from stp.sim.costs import Costs
from stp.sim.engine import simulate

HW = HARDWARE["a100-80g"]
DEEP = ModelSpec(layers=48, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
                 sequence=2048, gated_mlp=True, flash_attention=True, name="deep")
DEEP_ARG = "layers=48,hidden=1024,heads=16,kv_heads=4,ffn=4096,vocab=32000,sequence=2048"


@pytest.mark.parametrize("p,m", [(4, 8), (3, 6)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m):
    # Narayanan et al. (arXiv 2104.04473, 2.2.2): with F and a full backward
    # per rank share, the idle time of interleaved 1F1B is (p-1)/(v m) of the
    # compute; 1F1B is v = 1.
    costs = Costs(f=1.0, b=1.0, w=1.0)
    for v in (1, 2, 3, 4):
        sch = (generate("1f1b", p, m) if v == 1
               else generate("1f1b-interleaved", p, m, chunks=v))
        crit = simulate(sch, costs, record_spans=False).critical_rank
        assert crit.idle / crit.compute == pytest.approx((p - 1) / (v * m), rel=1e-9), v


def _in_flight_peak(sch, rank):
    """Most chunk-microbatches rank holds between their F and their backward."""
    held = peak = 0
    for action in sch.actions[rank]:
        for ps in passes_of(action):
            held += 1 if ps.kind is Kind.F else -1 if ps.kind in (Kind.B, Kind.BW) else 0
            peak = max(peak, held)
    return peak


def test_memory_estimate_holds_the_interleaved_chunks_in_flight():
    # Each rank keeps, at its peak, the chunk-microbatches interleaved 1F1B has
    # in flight there, each 1/v of its share's activations (M_B): on the first
    # rank p + (p-1)/v of M_B (Narayanan et al., 2.2.2: 1 + (p-1)/(p v) times
    # 1F1B's p), on the last p - (p-1)/v, so the first rank needs more than
    # 1F1B at every v and the last rank more as v grows; the estimate's bytes
    # follow the simulated units, and its send buffers grow with v.
    p, m = 3, 6
    model = ModelSpec(layers=36, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=1000,
                      sequence=512, name="mid")
    plain, _ = estimate_run(model, HW, Layout(pp=p, microbatches=m, seq_len=512,
                                              schedule="1f1b"), Features())
    per_unit, last_rank, buffers = set(), [], []
    for v in (2, 3, 4, 6):
        layout = Layout(pp=p, microbatches=m, seq_len=512, schedule="1f1b-interleaved",
                        chunks=v)
        est, res = estimate_run(model, HW, layout, Features())
        sch = res.schedule
        assert sch.chunks == v and sch.num_stages == p * v
        for rank in range(p):
            units = res.ranks[rank].peak_activation
            # the output layer on the last stage keeps more than a layer (under 1%)
            assert units == pytest.approx(_in_flight_peak(sch, rank) / v, rel=0.02), (v, rank)
            per_unit.add(round(est.ranks[rank].activations_peak / units, 3))
        # (the embedding on stage 0 keeps a few bytes besides its layers)
        assert res.ranks[0].peak_activation == pytest.approx(p + (p - 1) / v, rel=1e-4)
        assert est.ranks[0].activations_peak > plain.ranks[0].activations_peak
        last_rank.append(est.ranks[-1].activations_peak)
        buffers.append(est.ranks[1].buffers)
    assert len(per_unit) == 1  # one byte size per memory unit, whatever v
    assert last_rank == sorted(last_rank) and last_rank[0] < last_rank[-1]
    assert buffers == sorted(buffers) and buffers[0] < buffers[-1]


def test_chunk_options_fill_the_layers_up_to_max_chunks():
    assert chunk_options("1f1b", 4, 48) == [None]
    assert chunk_options("1f1b-interleaved", 1, 48) == [None]  # pp 1: chunks only add stages
    assert chunk_options("1f1b-interleaved", 4, 48) == list(range(2, MAX_CHUNKS + 1))
    assert chunk_options("zb-interleaved", 16, 126) == list(range(2, 8))  # 16 x 8 > 126


def _deep_request(**kw):
    # 9 sequences on 4 single-GPU nodes: dp 1 (9 is odd), tp 1, so pp 4, m 9.
    base = dict(model=DEEP, hardware=HW, gpus=4, global_batch=9, seq_len=2048,
                gpus_per_node=1, max_microbatch_size=1, schedules=("1f1b", "1f1b-interleaved"),
                partition="even", top=3)
    base.update(kw)
    return PlanRequest(**base)


def test_planner_picks_more_than_two_chunks_when_the_bubble_dominates():
    result = plan(_deep_request())
    best = result.plans[0]
    assert best.config.schedule == "1f1b-interleaved" and best.config.chunks > 2
    assert best.result.schedule.chunks == best.config.chunks
    two = [p for p in result.plans if p.config.chunks in (None, 2)]
    assert all(best.step_s < p.step_s for p in two)


def test_a_chunked_row_runs_from_its_schedule_file(capsys, tmp_path):
    # stp train has no --chunks: the row names the schedule file, --out writes
    # it beside the plan, and stp memory --chunks prices the row as the planner.
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", DEEP_ARG, "--gpus", "4", "--gpus-per-node", "1",
            "--global-batch", "9", "--seq-len", "2048", "--hardware", "a100-80g",
            "--max-microbatch-size", "1", "--schedules", "1f1b,1f1b-interleaved",
            "--partition", "even", "--top", "2", "--out", str(path)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "stp train has no --chunks" in text
    row = json.loads(path.read_text())["plans"][0]
    v = row["chunks"]
    assert v > 2 and row["job"]["schedule"] == row["schedule_file"]
    written = json.loads((tmp_path / row["schedule_file"].split("/")[-1]).read_text())
    assert written["num_ranks"] == 4 and len(set(written["stage_to_rank"])) == 4
    assert len(written["stage_to_rank"]) == 4 * v
    mem = ["memory", "--model", DEEP_ARG, "--hardware", "a100-80g", "--pp", "4", "-m", "9",
           "--microbatch-size", "1", "--seq-len", "2048", "--schedule", row["schedule"],
           "--chunks", str(v), "--json"]
    assert main(mem) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["memory"]["total"] == pytest.approx(row["peak_bytes"], rel=1e-12)
    assert got["memory"]["total"] <= HW.memory


def test_memory_chunks_refused_where_they_mean_nothing(capsys):
    base = ["memory", "--model", DEEP_ARG, "--pp", "4", "-m", "8", "--chunks", "4"]
    assert main([*base, "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "1f1b takes no chunks" in err
    assert main(["memory", "--pp", "2", "--chunks", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--chunks 4" in err


@pytest.mark.slow
def test_stp_train_plan_runs_a_chunked_row_from_its_file(capfd, tmp_path, monkeypatch):
    # The plan's v = 3 row runs through `stp train --plan` from the schedule
    # file `stp plan --out` wrote, with the losses of the same step at v = 2
    # (capfd: the pipeline ranks are worker processes that print themselves).
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model",
            "layers=6,hidden=16,heads=2,kv_heads=2,ffn=64,vocab=256,sequence=8",
            "--gpus", "2", "--gpus-per-node", "1", "--global-batch", "3", "--seq-len", "8",
            "--hardware", "a100-80g", "--schedules", "1f1b-interleaved", "--dtype", "float32",
            "--max-microbatch-size", "1", "--partition", "even", "--top", "2", "--out",
            "plan.json"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    row = next(r for r in doc["plans"] if r["chunks"] == 3)
    row["job"]["dtype"] = "float64"  # stp plan plans 16 and 32 bits; compare in float64
    (tmp_path / "v3.json").write_text(json.dumps({**doc, "plans": [row]}))
    capfd.readouterr()
    tiny = ["train", "--layers", "6", "--hidden", "16", "--heads", "2", "--steps", "2",
            "--timeout", "60", "--json"]

    def losses(extra):
        assert main([*tiny, *extra]) == 0
        rows = [json.loads(x) for x in capfd.readouterr().out.splitlines()
                if x.startswith("{")]
        return [r["loss"] for r in rows if "loss" in r]

    chunked = losses(["--plan", "v3.json", "--out", "a"])
    plain = losses(["--pp", "2", "--schedule", "1f1b-interleaved", "-m", "3",
                    "--microbatch-size", "1", "--seq-len", "8", "--dtype", "float64",
                    "--out", "b"])
    assert len(chunked) == 2 and chunked == pytest.approx(plain, abs=1e-9)
