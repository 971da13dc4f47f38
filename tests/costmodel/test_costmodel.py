"""Cost model: the published per-layer formulas, presets, derivation, parsing, CLI."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stp.cli.main import main
from stp.costmodel import (
    MODELS,
    ModelSpec,
    allreduce_time,
    derive,
    layer_activation_bytes,
    layer_flops,
    num_parameters,
    p2p_time,
    parse_hardware,
    parse_model,
)


def gpt(h: int, a: int, s: int, b: int, t: int = 1, **kw) -> ModelSpec:
    return ModelSpec(layers=4, hidden=h, heads=a, kv_heads=a, ffn=4 * h, vocab=1000,
                     sequence=s, micro_batch=b, tp=t, gated_mlp=False, **kw)


shapes = st.tuples(
    st.sampled_from([1, 2, 4, 8]),  # tp
    st.integers(1, 8).map(lambda k: 8 * k),  # heads
    st.integers(1, 16),  # head size / 8
    st.integers(1, 64).map(lambda k: 64 * k),  # sequence
    st.integers(1, 8),  # microbatch
)


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_gpt_layer_matches_zero_bubble_table_1_and_korthikanti(shape):
    t, a, d8, s, b = shape
    h = a * 8 * d8
    f, bw, w = layer_flops(gpt(h, a, s, b, t))
    # Zero Bubble (arXiv 2401.10241) Table 1: F = sbh(24h+4s), B = sbh(24h+8s), W = 24sbh^2.
    assert f * t == pytest.approx(s * b * h * (24 * h + 4 * s))
    assert bw * t == pytest.approx(s * b * h * (24 * h + 8 * s))
    assert w * t == pytest.approx(24 * s * b * h * h)
    m_b, m_w = layer_activation_bytes(gpt(h, a, s, b, t))
    # Korthikanti et al. 2023, eq. 2/4: sbh(10 + 24/t + 5as/(ht)); t = 1 gives ZB's sb(34h+5as).
    assert m_b == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    if t == 1:
        assert m_w == pytest.approx(32 * s * b * h)  # ZB Table 1
    m_b_sp, _ = layer_activation_bytes(gpt(h, a, s, b, t, sequence_parallel=True))
    assert m_b_sp == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))  # Korthikanti eq. 5


def test_flash_attention_drops_the_quadratic_term():
    plain = layer_activation_bytes(gpt(1024, 16, 2048, 1))[0]
    flash = layer_activation_bytes(gpt(1024, 16, 2048, 1, flash_attention=True))[0]
    assert plain - flash == pytest.approx(5 * 16 * 2048 * 2048)


def test_presets_have_the_sizes_their_names_say():
    sizes = {name: num_parameters(m, tied_embeddings=name.startswith("zb")) / 1e9
             for name, m in MODELS.items()}
    for name, want in [("zb-1.5b", 1.5), ("zb-6.2b", 6.2), ("zb-14.6b", 14.6),
                       ("zb-28.3b", 28.3), ("qwen2-12.1b", 12.1), ("qwen2-26.3b", 26.3)]:
        assert sizes[name] == pytest.approx(want, rel=0.02), name


def test_derive_scales_with_pipeline_and_tensor_parallel_size():
    hw = parse_hardware("a100-80g")
    m = parse_model("zb-6.2b")
    d2, d8 = derive(m, hw, 2), derive(m, hw, 8)
    assert d2.costs.f == pytest.approx(4 * d8.costs.f)
    assert d2.costs.ar == 0.0  # tp = 1
    assert d8.mem.m_b == 1.0 and 0 < d8.mem.m_w < 1
    assert d8.bytes_per_unit == pytest.approx(layer_activation_bytes(m)[0] * 30 / 8)
    f_fl = layer_flops(m)[0] * 30 / 8
    assert d8.costs.f == pytest.approx(f_fl / (hw.peak_flops * hw.efficiency) * 1e3)
    tp = derive(parse_model("zb-6.2b,tp=4"), hw, 8)
    assert tp.costs.f == pytest.approx(d8.costs.f / 4)
    n = 2 * 1024 * 3 * 4096  # one layer output, 16-bit
    assert tp.costs.ar == pytest.approx(2 * 30 / 8 * allreduce_time(
        n, 4, hw.tp_bandwidth, hw.tp_latency) * 1e3)
    assert tp.costs.comm == pytest.approx(p2p_time(n, hw.pp_bandwidth, hw.pp_latency) * 1e3)


def test_alpha_beta_times():
    assert allreduce_time(1e9, 1, 1e9, 1e-5) == 0.0
    assert allreduce_time(8e9, 4, 1e9, 0.0) == pytest.approx(2 * 3 / 4 * 8)
    assert p2p_time(1e9, 1e9, 0.5) == pytest.approx(1.5)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("gpt-9", "unknown model preset 'gpt-9'; choose one of: zb-1.5b"),
        ("zb-1.5b,depth=3", "unknown model key 'depth'"),
        ("zb-1.5b,tp=two", "model tp='two' is not a valid int"),
        ("zb-1.5b,tp=5", "tp=5 must divide heads=24"),
        ("layers=2,hidden=64", "needs every required field"),
    ],
)
def test_bad_model_text_is_refused(text, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("'", "'")):
        parse_model(text)


def test_bad_hardware_and_pipeline_are_refused():
    with pytest.raises(ValueError, match="efficiency=1.5 must be in"):
        parse_hardware("a800-80g,efficiency=1.5")
    with pytest.raises(ValueError, match="exceeds the model's 22 layers"):
        derive(parse_model("zb-1.5b"), parse_hardware("a100-80g"), 32)


def test_cli_model_and_hardware_options(capsys):
    argv = ["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8",
            "--model", "zb-1.5b", "--hardware", "a800-80g", "--json"]
    assert main(argv) == 0
    obj = json.loads(capsys.readouterr().out)
    want = derive(parse_model("zb-1.5b"), parse_hardware("a800-80g"), 4)
    assert obj["costs"]["f"] == pytest.approx(want.costs.f)
    assert obj["mem"]["w"] == pytest.approx(want.mem.m_w)
    # --cost keys override the derived values
    assert main([*argv, "--cost", "comm=0"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"]["comm"] == 0
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8",
                 "--hardware", "a800-80g"]) == 2
    assert "--hardware needs --model" in capsys.readouterr().err
