"""The cost model of a mixture of experts (`stp.costmodel.moe`): the published
presets, the all-to-all's bytes and link, the decoder formulas it reuses, and
its bytes per rank with expert parallelism (`stp.costmodel.memory`)."""

from dataclasses import fields, replace

import pytest

from stp.cli.main import main
from stp.costmodel import MODELS, ModelSpec, derive, layer_flops, num_parameters
from stp.costmodel.configs import spec_from_config, spec_from_hf_json
from stp.costmodel.decoder.spec import layer_activation_bytes
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.memory import Features, Layout, estimate
from stp.costmodel.moe.spec import MoESpec, a2a_bytes, a2a_time, active_parameters
from stp.shapes import MoEConfig

HW = HardwareSpec(peak_flops=1e15, tp_bandwidth=100e9, tp_latency=0.0, pp_bandwidth=10e9,
                  pp_latency=0.0, node_gpus=8)
TINY = MoESpec(layers=4, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, sequence=32,
               micro_batch=2, experts=4, top_k=2, expert_ffn=48, ep=2, dropout=False)


def _dense(spec: MoESpec) -> ModelSpec:
    """The decoder `spec` is with its MLP dense."""
    return ModelSpec(**{f.name: getattr(spec, f.name) for f in fields(ModelSpec)})


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9),
                                               ("qwen2-57b-a14b", 57.4e9, 14.2e9)])
def test_presets_match_their_published_sizes(name: str, total: float, active: float):
    """Mixtral of Experts (arXiv 2401.04088): 46.7B parameters, 12.9B active; Qwen2
    (arXiv 2407.10671): 57B, 14B active (57.4B / 14.2B from its config.json)."""
    spec = MODELS[name]
    assert num_parameters(spec) == pytest.approx(total, rel=0.005)
    assert active_parameters(spec) == pytest.approx(active, rel=0.01)


def test_all_to_all_bytes_are_tokens_top_k_hidden_dtype_and_the_share_sent_away():
    s, b, k, h = 32, 2, 2, 64
    assert a2a_bytes(TINY) == s * b * k * h * 2 * (2 - 1) / 2
    assert a2a_bytes(replace(TINY, ep=4), dtype_bytes=4) == s * b * k * h * 4 * 3 / 4
    assert a2a_bytes(replace(TINY, ep=1)) == 0
    assert a2a_time(replace(TINY, ep=1), HW) == 0


def test_all_to_all_link_is_nvlink_within_a_node_and_the_network_past_it():
    """EP ranks are consecutive dp ranks of t GPUs each: 8 / t of them share a node."""
    one_node = replace(TINY, ep=4, tp=2)  # 8 GPUs
    per_peer = a2a_bytes(one_node) / 3
    assert a2a_time(one_node, HW) == pytest.approx(3 * per_peer / HW.tp_bandwidth)
    spread = replace(TINY, ep=4, tp=4)  # 16 GPUs: one peer local, two remote
    per_peer = a2a_bytes(spread) / 3
    assert a2a_time(spread, HW) == pytest.approx(2 * per_peer / HW.pp_bandwidth)
    slow_latency = replace(HW, pp_latency=1e-3)
    assert a2a_time(spread, slow_latency) == pytest.approx(
        3e-3 + 2 * per_peer / HW.pp_bandwidth)


def test_derived_costs_charge_two_all_to_alls_per_moe_layer():
    d = derive(TINY, HW, 2)
    assert d.costs.a2a == pytest.approx(2 * 2 * a2a_time(TINY, HW) * 1e3)  # 2 layers a rank
    every_other = replace(TINY, moe_every=2)
    assert derive(every_other, HW, 2).costs.a2a == pytest.approx(d.costs.a2a / 2)
    assert derive(replace(TINY, ep=1), HW, 2).costs.a2a == 0
    assert derive(_dense(TINY), HW, 2).costs.a2a == 0


def test_one_expert_of_full_width_is_the_dense_layer():
    """E = k = 1 with the dense width: the same FLOPs, and one routed copy more."""
    moe = replace(TINY, experts=1, top_k=1, expert_ffn=TINY.ffn, ep=1)
    dense = _dense(TINY)
    assert layer_flops(moe) == layer_flops(dense)
    s, b, h = 32, 2, 64
    m_b, m_w = layer_activation_bytes(moe)
    d_b, d_w = layer_activation_bytes(dense)
    assert m_b == pytest.approx(d_b + s * b * (4 * h + 8 + 12))
    assert m_w == pytest.approx(d_w + 2 * s * b * 2 * h)
    assert num_parameters(moe) == num_parameters(dense) + 4 * h  # the router, h x E


def test_bad_moe_fields_are_refused_in_one_line():
    for changed, said in (({"ep": 3}, "ep=3 must divide experts=4"),
                         ({"top_k": 5}, "top_k=5 must be <= experts=4"),
                         ({"moe_every": 9}, "moe_every=9 must be <= layers=4"),
                         ({"shared_expert_ffn": -1}, "must be an integer >= 0")):
        with pytest.raises(ValueError, match=said):
            replace(TINY, **changed)


def test_expert_states_shard_over_the_expert_data_parallel_group():
    """Each rank holds experts / ep of its layers (each split by t); the sharded
    optimizer divides dense masters and moments by dp, expert ones by dp / ep."""
    layout = Layout(pp=2, tp=1, dp=4, microbatches=4, seq_len=32, microbatch_size=2,
                    schedule="1f1b", ep=2)
    plain = estimate(TINY, HW, layout).ranks
    sharded = estimate(TINY, HW, layout, Features(shard_optimizer=True)).ranks
    experts = 2 * 3 * 64 * 48 * 4 / 2  # two layers a rank, E / ep experts of 3 h f_e
    no_ep = estimate(TINY, HW, replace(layout, ep=1)).ranks
    for a, b, c in zip(plain, sharded, no_ep, strict=True):
        assert c.parameters - a.parameters == experts
        dense = a.parameters - experts
        assert b.masters == pytest.approx(4 * (dense / 4 + experts / 2))
        assert b.optimizer == pytest.approx(8 * (dense / 4 + experts / 2))
        assert a.masters == 4 * a.parameters and b.weights == a.weights
        a2a_buffers = 2 * 2 * 32 * 2 * 64 * 2 * 2  # two passes, send + receive, s b k h
        # bf16 without the sharded optimizer: the DP reduction copies nothing
        assert a.copies == c.copies == 0
        assert a.buffers - c.buffers == pytest.approx(a2a_buffers)
    assert estimate(TINY, HW, layout).layout.ep == 2


def test_layout_ep_is_checked():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        Layout(pp=2, dp=4, ep=3)
    dense = MODELS["zb-1.5b"]
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        estimate(dense, HW, Layout(pp=2, dp=2, ep=2, seq_len=64))
    est = estimate(TINY, HW, Layout(pp=2, dp=1, seq_len=32, schedule="1f1b"))
    assert est.layout.ep == 1 and "ep=2 does not divide dp=1" in est.notes[-1]


def test_specs_from_an_moe_config_and_its_config_json():
    cfg = MoEConfig(vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    num_experts=4, top_k=2, expert_ffn=48, shared_expert_ffn=32)
    spec = spec_from_config(cfg, seq_len=16)
    assert isinstance(spec, MoESpec)
    assert (spec.experts, spec.top_k, spec.expert_ffn, spec.shared_expert_ffn) == (4, 2, 48, 32)
    obj = {"model_type": "qwen2_moe", "hidden_size": 3584, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
           "vocab_size": 151936, "num_experts": 64, "num_experts_per_tok": 8,
           "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480,
           "decoder_sparse_step": 1}
    assert num_parameters(spec_from_hf_json(obj, "c.json")) == num_parameters(
        MODELS["qwen2-57b-a14b"])
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
               "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert num_parameters(spec_from_hf_json(mixtral, "c.json")) == num_parameters(
        MODELS["mixtral-8x7b"])
    with pytest.raises(ValueError, match="num_experts_per_tok=None"):
        spec_from_hf_json({k: v for k, v in mixtral.items() if k != "num_experts_per_tok"},
                          "c.json")


def test_cli_simulates_and_prices_the_presets(capsys):
    code = main(["simulate", "--model", "mixtral-8x7b,tp=2", "--hardware", "h100-80g",
                 "--pp", "4", "-m", "8", "--schedule", "stp"])
    out = capsys.readouterr().out
    assert code == 0 and "a2a=" in out and "exposed_a2a" in out and "a2a_bubble" in out
    code = main(["memory", "--model", "qwen2-57b-a14b", "--pp", "4", "--dp", "8", "-m", "8",
                 "--shard-optimizer"])
    out = capsys.readouterr().out
    assert code == 0 and "ep=8" in out
    for argv, said in ((["simulate", "--schedule", "stp", "--pp", "2", "-m", "4", "--cost",
                         "a2a=-1"], "a2a=-1"),
                       (["simulate", "--model", "mixtral-8x7b,ep=3", "--pp", "2", "-m", "4",
                         "--schedule", "stp"], "ep=3 must divide experts=8"),
                       (["memory", "--model", "mixtral-8x7b,ep=16", "--pp", "2"],
                        "ep=16 must divide experts=8")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen2-57b-a14b"])
def test_what_w_keeps_never_exceeds_what_b_keeps(name: str):
    """The simulator needs M_W <= M_B (B frees, W frees the rest): every TP size the
    heads allow, with and without sequence parallelism and recomputation."""
    for tp in (1, 2, 4, 8):
        for sp in (False, True):
            for mode in ("none", "selective", "full"):
                try:
                    spec = replace(MODELS[name], tp=tp, sequence_parallel=sp, recompute=mode)
                except ValueError:
                    continue  # tp does not divide the heads
                m_b, m_w = layer_activation_bytes(spec)
                assert 0 < m_w <= m_b, (tp, sp, mode)


def test_draw_shows_the_all_to_alls(tmp_path, capsys):
    out = tmp_path / "moe.svg"
    assert main(["draw", "--model", "mixtral-8x7b,tp=2", "--pp", "2", "-m", "4", "--schedule",
                 "stp", "--out", str(out)]) == 0
    capsys.readouterr()
    svg = out.read_text()
    assert "expert all-to-all (A2A)" in svg and "A2A of " in svg
