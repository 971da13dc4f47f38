"""`stp plan` on a mixture of experts: ep searched as a mesh axis, priced, bounded, reported."""

import json
from dataclasses import replace

import pytest

from stp.cli.main import main
from stp.costmodel import HARDWARE
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.moe.spec import MoESpec
from stp.plan import NoPlan, PlanRequest, plan
from stp.plan.experts import bound_memory, bound_time, priced
from stp.plan.planner import priced_at
from stp.plan.price import price
from stp.plan.space import BRAIDED, Config, Mesh, every_config, levers_for, meshes, schedules_for
from stp.schedule.ir import passes_of
from stp.schedule.registry import SCHEDULES, generate

MOE = MoESpec(layers=2, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
              sequence=2048, gated_mlp=True, flash_attention=True, name="moe-small",
              experts=8, top_k=2, expert_ffn=2048)
MOE_ARG = ("mixtral-8x7b,layers=2,hidden=1024,heads=16,kv_heads=4,ffn=4096,vocab=32000,"
           "sequence=2048,experts=8,top_k=2,expert_ffn=2048")
SMALL_DENSE = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
                        sequence=2048, gated_mlp=True, flash_attention=True, name="dense")
HW = HARDWARE["a100-80g"]


def _request(**kw):
    # no TP (one GPU a node): dp 4 or 8, where expert parallelism is the lever
    base = dict(model=MOE, hardware=HW, gpus=8, global_batch=16, seq_len=2048,
                gpus_per_node=1, schedules=("1f1b",), partition="even", top=3)
    base.update(kw)
    return PlanRequest(**base)


def test_ep_ranges_over_the_divisors_of_dp_that_divide_the_experts():
    request = _request(model=replace(MOE, layers=8, experts=12), gpus=24, gpus_per_node=4,
                       global_batch=48)
    got = list(meshes(request))
    dense = list(meshes(replace(request, model=SMALL_DENSE)))
    assert all(m.ep == 1 for m in dense)
    assert sorted({(m.pp, m.tp, m.dp) for m in got}) == sorted((m.pp, m.tp, m.dp) for m in dense)
    for pp, tp, dp in {(m.pp, m.tp, m.dp) for m in got}:
        eps = sorted(m.ep for m in got if (m.pp, m.tp, m.dp) == (pp, tp, dp))
        assert eps == [e for e in range(1, dp + 1) if dp % e == 0 and 12 % e == 0]
    assert {m.ep for m in got} == {1, 2, 3, 4, 6, 12}
    held = list(meshes(replace(request, ep=(2,))))
    assert held and all(m.ep == 2 for m in held)


def test_bounds_stay_below_the_simulated_price_at_every_ep():
    # The planner skips configurations on these bounds, so they must hold for
    # unbraided schedules (exposed all-to-alls) and sharded experts too.
    request = _request(model=replace(MOE, layers=4), gpus_per_node=2,
                       schedules=("1f1b", "zb-v", "stp", "1f1b-interleaved"))
    configs = list(every_config(request))
    assert {c.mesh.ep for c in configs} == {1, 2, 4, 8}
    for cfg in configs[::5]:
        got = priced(request, cfg)
        assert bound_time(request, cfg) <= got.step_s * (1 + 1e-9), cfg
        assert bound_memory(request, cfg) <= got.peak_bytes * (1 + 1e-9), cfg


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in BRAIDED])
def test_schedules_not_braided_run_one_pass_an_action(name):
    # The time bound charges these schedules the collectives of every F unit,
    # which holds only when no action braids two passes.
    for p, m in ((4, 8), (2, 3)):
        sch = generate(name, p, m)
        assert all(len(passes_of(a)) == 1 for acts in sch.actions for a in acts), (p, m)


def test_top_k_equals_the_exhaustive_ranking_over_ep():
    budget = 1.6e9
    request = _request(model=replace(MOE, layers=4), gpus_per_node=2, memory_budget=budget,
                       schedules=("1f1b", "zb-v", "stp"))
    best: dict[tuple, float] = {}
    for cfg in every_config(request):
        key = (cfg.mesh, cfg.microbatch_size, cfg.schedule, cfg.chunks)
        if key not in best:
            got = priced(request, cfg)
            if got.peak_bytes <= budget:
                best[key] = got.step_s
    result = plan(request)
    assert [p.step_s for p in result.plans] == pytest.approx(sorted(best.values())[:3],
                                                             rel=1e-12)
    assert result.pruned_time > 0


def test_ep_is_what_makes_a_tight_budget_fit():
    # 1 GB: at ep 1 every rank of the dp4 mesh holds all 8 experts of its layer
    # and no lever fits them; at ep 4 a rank holds 2, and the plan fits.
    with pytest.raises(NoPlan, match="held to --ep 1"):
        plan(_request(memory_budget=1.0e9, ep=(1,)))
    got = plan(_request(memory_budget=1.0e9)).plans
    assert got and all(p.config.mesh.ep > 1 and p.peak_bytes <= 1.0e9 for p in got)


def test_ep_wins_by_the_expert_gradients_it_does_not_sync():
    # No memory pressure: ep 4 on dp 4 is faster than ep 1 because the experts'
    # gradients sync over dp / ep = 1 rank instead of 4; the all-to-all it adds
    # costs less than the sync it saves.
    request = _request()
    best = plan(request).plans[0]
    mesh = best.config.mesh
    assert mesh.ep > 1
    plain = priced_at(request, replace(mesh, ep=1), best.config.microbatch_size, "1f1b")
    assert plain is not None and best.step_s < plain.step_s
    saved_sync = plain.dp_sync_s - best.dp_sync_s
    assert saved_sync > plain.step_s - best.step_s > 0
    assert best.result.critical_rank.a2a_total > 0 and plain.result.critical_rank.a2a_total == 0


def _plan_cli(capsys, *extra, model=MOE_ARG):
    argv = ["plan", "--model", model, "--gpus", "8", "--gpus-per-node", "1", "--hardware",
            "a100-80g", "--global-batch", "16", "--seq-len", "2048", "--schedules",
            "1f1b,zb-v", "--top", "3", *extra]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_rows_carry_ep_and_the_train_flags_pass_it_on(capsys):
    out = json.loads(_plan_cli(capsys, "--json"))
    for r in out["plans"]:
        assert r["dp"] % r["ep"] == 0 and 8 % r["ep"] == 0
        if r["ep"] > 1:
            assert r["job"]["ep"] == r["ep"]
            assert r["flags"][r["flags"].index("--ep") + 1] == str(r["ep"])
        else:
            assert "ep" not in r["job"] and "--ep" not in r["flags"]
    assert out["plans"][0]["ep"] > 1
    table = _plan_cli(capsys).splitlines()
    assert table[0].split()[:5] == ["#", "pp", "tp", "dp", "ep"]
    assert f"--ep {out['plans'][0]['ep']}" in table[4]


def test_a_dense_plan_has_no_ep(capsys):
    dense = "layers=2,hidden=1024,heads=16,kv_heads=4,ffn=4096,vocab=32000,sequence=2048"
    out = json.loads(_plan_cli(capsys, "--json", model=dense))
    assert all("ep" not in r and "--ep" not in r["flags"] for r in out["plans"])
    assert "ep" not in _plan_cli(capsys, model=dense).splitlines()[0].split()


def test_every_row_fits_by_stp_memory(capsys):
    # `stp memory` on each recommended configuration, at its ep, stays within the
    # limit and agrees with the planner to the byte.
    out = json.loads(_plan_cli(capsys, "--json", "--memory-budget", "1.2GB"))
    for r in out["plans"]:
        job = r["job"]
        argv = ["memory", "--model", f"{MOE_ARG},ep={r['ep']}", "--hardware",
                "a100-80g,node_gpus=1", "--pp", str(job["pp"]), "--tp", str(job["tp"]),
                "--dp", str(job["dp"]), "--ep", str(r["ep"]), "-m", str(job["microbatches"]),
                "--microbatch-size", str(job["microbatch_size"]), "--seq-len", "2048",
                "--schedule", r["schedule"], "--memory-budget", "1.2GB",
                "--recompute", job.get("recompute", "none"), "--offload",
                job.get("offload", "none"), "--json"]
        argv += ["--sequence-parallel"] * bool(job.get("sequence_parallel"))
        argv += ["--shard-optimizer"] * bool(job.get("shard_optimizer"))
        assert main(argv) == 0, r
        mem = json.loads(capsys.readouterr().out)
        assert mem["memory"]["total"] == pytest.approx(r["peak_bytes"], rel=1e-12)
        assert mem["memory"]["total"] <= 1.2e9


@pytest.mark.parametrize("extra,message", [
    (["--ep", "3"], "--ep 3: must divide the model's 8 experts"),
    (["--ep", "two"], "--ep 'two': integers separated by commas"),
    (["--ep", "8", "--global-batch", "12"], "and by one of --ep 8; GPU counts that do"),
    (["--ep", "1", "--memory-budget", "0.9GB"], "held to --ep 1"),
    (["--memory-budget", "0.8GB"], "its 8 experts admit ep 1, 2, 4, 8"),
])
def test_bad_moe_requests_are_one_line(capsys, extra, message):
    argv = ["plan", "--model", MOE_ARG, "--gpus", "8", "--gpus-per-node", "1", "--hardware",
            "a100-80g", "--global-batch", "16", "--seq-len", "2048", "--schedules", "1f1b",
            *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("stp: error:") and message in err


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; dense has no"):
        _request(model=SMALL_DENSE, ep=(2,))


def test_a_qwen2_moe_config_json_is_planned_over_ep(capsys, tmp_path):
    config = {"model_type": "qwen2_moe", "hidden_size": 1024, "num_hidden_layers": 2,
              "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 4096,
              "vocab_size": 32000, "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 2048, "shared_expert_intermediate_size": 1024,
              "decoder_sparse_step": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = json.loads(_plan_cli(capsys, "--json", model=str(tmp_path)))
    assert out["plans"][0]["ep"] > 1 and "--ep" in out["plans"][0]["flags"]


def test_braided_schedules_are_tried_where_they_hide_an_all_to_all():
    # At tp 1 the braid has no all-reduce to hide, but at ep > 1 it hides the
    # experts' all-to-alls (stp.sim.engine), so STP and DualPipeV are tried.
    request = _request(model=replace(MOE, layers=8), schedules=None)
    names = {ep: {n for n, _ in schedules_for(request, Mesh(2, 1, 4, ep))} for ep in (1, 4)}
    assert not names[1] & set(BRAIDED) and set(BRAIDED) <= names[4]


def test_a_spec_ep_that_does_not_divide_dp_syncs_as_ep_1():
    # stp.costmodel.memory prices a spec's own ep that does not divide dp at ep 1
    # (with a note); the experts' gradient sync must follow it, not the spec.
    cfg = Config(Mesh(2, 1, 4), 1, 4, "1f1b", levers_for(_request(), Mesh(2, 1, 4))[0][1])
    own = price(replace(MOE, ep=8), HW, cfg, 2048)
    one = price(MOE, HW, cfg, 2048)
    assert own.estimate.notes and own.dp_sync_s == one.dp_sync_s > 0
