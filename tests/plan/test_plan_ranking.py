"""`stp plan`: bounds that prune, an exact top K, rows that fit, one-line refusals."""

import json
from dataclasses import replace

import pytest

from stp.cli.main import main
from stp.costmodel import HARDWARE
from stp.costmodel.decoder.spec import ModelSpec
from stp.plan import NoPlan, PlanRequest, plan
from stp.plan.price import memory_bound, price, time_bound
from stp.plan.space import every_config

SMALL = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
                  sequence=2048, gated_mlp=True, flash_attention=True, name="small")
MODEL_ARG = "layers=8,hidden=1024,heads=16,kv_heads=4,ffn=4096,vocab=32000,sequence=2048"
HW = HARDWARE["a100-80g"]


def _request(**kw):
    base = dict(model=SMALL, hardware=HW, gpus=8, global_batch=16, seq_len=2048,
                gpus_per_node=4, schedules=("1f1b", "zb-v", "stp", "1f1b-interleaved"),
                partition="even", top=3)
    base.update(kw)
    return PlanRequest(**base)


def test_bounds_never_exceed_the_simulated_price():
    # The planner skips a configuration on these bounds, so they must hold.
    request = _request()
    for cfg in list(every_config(request))[::7]:
        got = price(SMALL, HW, cfg, 2048)
        assert time_bound(SMALL, HW, cfg, 2048) <= got.step_s * (1 + 1e-9), cfg
        assert memory_bound(SMALL, HW, cfg, 2048) <= got.peak_bytes * (1 + 1e-9), cfg


def test_top_k_equals_the_exhaustive_ranking_under_a_tight_budget():
    # A budget that rules out some configurations without levers: the pruned
    # search must return what pricing every configuration at every lever would.
    budget = 6.0e9
    # the overlap step (stp.plan.overlap) lifts the exact top K afterwards: off here
    request = _request(memory_budget=budget, tp_overlap=False)
    best: dict[tuple, float] = {}
    for cfg in every_config(request):
        key = (cfg.mesh, cfg.microbatch_size, cfg.schedule, cfg.chunks)
        if key in best:
            continue  # a lower lever already fits: later levers are not faster
        got = price(SMALL, HW, cfg, 2048)
        if got.peak_bytes <= budget:
            best[key] = got.step_s
    want = sorted(best.values())[:3]
    result = plan(request)
    assert [p.step_s for p in result.plans] == pytest.approx(want, rel=1e-12)
    assert result.pruned_time > 0  # the bound spared some simulations
    assert all(p.peak_bytes <= budget for p in result.plans)


def test_a_tight_budget_turns_levers_on():
    loose = plan(_request(schedules=("1f1b",), top=1)).plans[0]
    need = loose.peak_bytes
    tight = plan(_request(schedules=("1f1b",), top=1, memory_budget=0.6 * need)).plans[0]
    f = tight.config.features
    assert tight.peak_bytes <= 0.6 * need
    assert f.shard_optimizer or f.sequence_parallel or f.recompute != "none" \
        or f.offload != "none" or tight.config.mesh != loose.config.mesh


def _plan_json(capsys, *extra):
    argv = ["plan", "--model", MODEL_ARG, "--gpus", "8", "--gpus-per-node", "4",
            "--hardware", "a100-80g", "--global-batch", "16", "--seq-len", "2048",
            "--schedules", "1f1b,zb-v,stp", "--top", "3", *extra]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_rows_cover_the_cluster_and_the_batch(capsys):
    out = _plan_json(capsys, "--memory-budget", "7GB")
    rows = out["plans"]
    assert len(rows) == 3 and out["why"]
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    for r in rows:
        assert {"pp", "tp", "dp", "schedule", "microbatch_size", "microbatches", "step_time_s",
                "mfu", "peak_bytes", "flags"} <= set(r)
        assert r["pp"] * r["tp"] * r["dp"] == 8
        assert r["dp"] * r["microbatches"] * r["microbatch_size"] == 16
        assert 0 < r["mfu"] < 1 and r["peak_bytes"] <= 7e9


def test_every_row_fits_by_stp_memory(capsys):
    # `stp memory` on each recommended configuration stays within the limit.
    out = _plan_json(capsys, "--memory-budget", "7GB", "--partition", "auto")
    for r in out["plans"]:
        job = r["job"]
        argv = ["memory", "--model", MODEL_ARG, "--hardware", "a100-80g", "--pp",
                str(job["pp"]), "--tp", str(job["tp"]), "--dp", str(job["dp"]), "-m",
                str(job["microbatches"]), "--microbatch-size", str(job["microbatch_size"]),
                "--seq-len", "2048", "--schedule", r["schedule"], "--memory-budget", "7GB",
                "--recompute", job.get("recompute", "none"), "--offload",
                job.get("offload", "none"), "--json"]
        argv += ["--sequence-parallel"] * bool(job.get("sequence_parallel"))
        argv += ["--shard-optimizer"] * bool(job.get("shard_optimizer"))
        argv += ["--partition", job["partition"]] if "partition" in job else []
        argv += ["--chunks", str(r["chunks"])] if "schedule_file" in r else []
        assert main(argv) == 0, r
        mem = json.loads(capsys.readouterr().out)
        assert mem["memory"]["total"] == pytest.approx(r["peak_bytes"], rel=1e-12)


def test_out_writes_the_plans(capsys, tmp_path):
    path = tmp_path / "plan.json"
    out = _plan_json(capsys, "--out", str(path))
    assert json.loads(path.read_text())["plans"] == out["plans"]


def test_no_mesh_names_gpu_counts_that_work(capsys):
    # 11 GPUs: pp 11 exceeds 8 layers, tp 11 divides no heads, dp 11 no batch of 16.
    argv = ["plan", "--model", MODEL_ARG, "--gpus", "11", "--global-batch", "16",
            "--seq-len", "2048", "--hardware", "a100-80g"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--gpus 11" in err and "10 or 12" in err


def test_nothing_fits_names_the_gpus_that_would(capsys):
    request = _request(gpus=4, global_batch=16, memory_budget=0.4e9, schedules=("1f1b",))
    with pytest.raises(NoPlan, match=r"GPUs would fit|no count up to"):
        plan(request)
    argv = ["plan", "--model", MODEL_ARG, "--gpus", "4", "--gpus-per-node", "4",
            "--global-batch", "16", "--seq-len", "2048", "--hardware", "a100-80g",
            "--schedules", "1f1b", "--memory-budget", "0.4GB"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no configuration of 4 GPUs fits" in err


def test_bad_values_are_one_line(capsys):
    for extra in (["--schedules", "nope"], ["--memory-budget", "lots"],
                  ["--hardware", "tpu-v9"]):
        argv = ["plan", "--model", MODEL_ARG, "--gpus", "8", "--global-batch", "16",
                "--seq-len", "2048", *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("stp: error:")


def test_request_validates_itself():
    with pytest.raises(ValueError, match="--gpus"):
        _request(gpus=0)
    with pytest.raises(ValueError, match="device memory"):
        _request(hardware=replace(HW, memory=0.0))


def test_a_batch_too_large_to_cut_is_one_line():
    with pytest.raises(NoPlan, match="raise --max-microbatch-size"):
        plan(_request(gpus=1, global_batch=1 << 20, max_microbatch_size=1))


def test_the_gpu_count_named_for_a_model_that_fits_nowhere_is_the_smallest_that_fits():
    # The refusal's count is the one to ask for: it plans, and the node
    # multiple below it does not.
    tight = dict(global_batch=16, memory_budget=0.4e9, schedules=("1f1b",))
    with pytest.raises(NoPlan) as refused:
        plan(_request(gpus=4, **tight))
    named = int(str(refused.value).split("; ")[-1].split(" GPUs would fit")[0])
    got = plan(_request(gpus=named, **tight))
    assert got.plans and all(p.peak_bytes <= 0.4e9 for p in got.plans)
    with pytest.raises(NoPlan):
        plan(_request(gpus=named - 4, **tight))


def test_top_1_does_not_call_the_best_the_only_one_that_fits():
    """`--top 1` said "the only configuration that fits" where `--top 2` on the same
    request shows a second one that fits."""
    from stp.plan.report import why

    two = plan(_request(top=2))
    assert len(two.plans) == 2  # a second configuration fits
    one = plan(_request(top=1))
    text = why(one.plans[0], None, one)
    assert "only configuration" not in text and "best of" in text
