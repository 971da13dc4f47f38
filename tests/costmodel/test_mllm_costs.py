"""Multimodal costs: the vision encoder's FLOPs, the `mllm-qwen2vl-7b` preset,
per-stage costs over encoder and decoder layers, and the CLI on the preset."""

from __future__ import annotations

import json

import pytest

from stp.cli.main import main
from stp.costmodel import derive, parse_hardware, parse_model
from stp.costmodel.mllm.costs import mllm_layered_costs
from stp.costmodel.mllm.spec import (
    MLLM_MODELS,
    MLLMSpec,
    merger_flops,
    vision_layer_flops,
    vision_parameters,
)

HW = parse_hardware("a800-80g")


def _small(**kw: int) -> MLLMSpec:
    base = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100, sequence=10,
                vision_layers=3, vision_hidden=8, vision_heads=2, vision_mlp=24, patch=2,
                merge=2, images=2, resolution=8, micro_batch=3, tp=1)
    base.update(kw)
    return MLLMSpec(**base)  # type: ignore[arg-type]


def test_vision_flops_follow_the_formula_by_hand():
    spec = _small()
    n, i, b, h, f = 16, 2, 3, 8, 24  # (8 / 2)^2 patches per image
    linear = 2 * n * i * b * (4 * h * h + 2 * h * f)
    attn = 4 * n * n * i * b * h  # each image's own n x n attention
    assert vision_layer_flops(spec) == pytest.approx((linear + attn, linear + 2 * attn, linear))
    assert merger_flops(spec) == pytest.approx(2 * (n // 4) * i * b * (4 * h) * (4 * h + 64))
    halved = vision_layer_flops(_small(tp=2))
    assert halved == pytest.approx(tuple(x / 2 for x in vision_layer_flops(spec)))
    assert spec.image_tokens == i * n // 4 and spec.decoder_sequence == 10 + i * n // 4


def test_the_preset_has_qwen2_vl_7b_s_675m_vision_tower():
    spec = parse_model("mllm-qwen2vl-7b")
    assert isinstance(spec, MLLMSpec)
    assert vision_parameters(spec) == pytest.approx(675e6, rel=0.01)
    assert spec.total_layers == 32 + 28 and spec.patches == 1024 and spec.image_tokens == 256
    big = parse_model("mllm-qwen2vl-7b,images=2,resolution=896")
    assert isinstance(big, MLLMSpec) and big.image_tokens == 2 * 1024
    with pytest.raises(ValueError, match="resolution=450 must be a multiple of"):
        parse_model("mllm-qwen2vl-7b,resolution=450")
    # tp=8 does not divide 28 heads: costed as 1/8 of the work per rank
    d4, d8 = (derive(parse_model(f"mllm-qwen2vl-7b,tp={t}"), HW, 2) for t in (4, 8))
    assert d8.flops_per_rank == pytest.approx(tuple(x / 2 for x in d4.flops_per_rank))


def test_stage_tables_count_vision_layers_first_and_add_up_to_the_rank_share():
    spec = MLLM_MODELS["mllm-qwen2vl-7b"]
    d = derive(spec, HW, 2)
    lc = mllm_layered_costs(spec, HW, 2, d.costs, d.mem)
    table = lc.table((34, 26))
    s0, s1 = table.stages
    extras = lc.first.f + lc.last.f
    assert s0.f + s1.f - extras == pytest.approx(2 * d.costs.f)
    assert s0.f == pytest.approx(32 * lc.vision.f + lc.merger.f + 2 * lc.layer.f + lc.first.f)
    assert s1.f == pytest.approx(26 * lc.layer.f + lc.last.f)
    assert lc.vision.compute < lc.layer.compute  # a 1280-wide block vs a 3584-wide layer
    # the merger rides with the last encoder block, wherever that is
    split = lc.table((20, 40)).stages
    assert split[1].f == pytest.approx(12 * lc.vision.f + lc.merger.f + 28 * lc.layer.f
                                       + lc.last.f)


def test_compare_on_the_preset_prints_stp_s_gain_over_the_best_baseline(capsys):
    assert main(["compare", "--pp", "2", "-m", "8", "--model", "mllm-qwen2vl-7b,tp=8",
                 "--hardware", "a800-80g", "--partition", "auto",
                 "--schedules", "1f1b-interleaved,zb-v,stp", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    spans = {r["schedule"]: r["makespan"] for r in doc["rows"]}
    best = min(spans["1f1b-interleaved"], spans["zb-v"])
    assert doc["stp_gain_over_best_baseline"] == pytest.approx(best / spans["stp"] - 1)
    assert doc["stp_gain_over_best_baseline"] > 0
    assert main(["compare", "--pp", "2", "-m", "4", "--schedules", "1f1b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stp_gain_over_best_baseline"] is None


@pytest.mark.parametrize("counts", ["30,20", "28,28", "40,30"])
def test_a_partition_must_count_vision_and_decoder_layers(capsys, counts):
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                 "--model", "mllm-qwen2vl-7b", "--partition", counts]) == 2
    err = capsys.readouterr().err
    assert "32 vision + 28 decoder = 60" in err and err.count("\n") == 1, err
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                 "--model", "mllm-qwen2vl-7b", "--partition", "33,27"]) == 0


def test_more_stages_than_decoder_layers_prices_the_head_in_the_same_bytes():
    """The encoder's blocks fill the pipeline, so pp may exceed the decoder's layers;
    the head's memory, in units of one rank's share, grows with pp and nothing else."""
    from dataclasses import replace

    from stp.costmodel.mllm.costs import derive_mllm

    spec = replace(MLLM_MODELS["mllm-qwen2vl-7b"], layers=2)
    hw = parse_hardware("a800-80g")
    last = {}
    for pp in (2, 3):
        d = derive_mllm(spec, hw, pp)
        last[pp] = mllm_layered_costs(spec, hw, pp, d.costs, d.mem).last
    assert last[3].f == last[2].f
    assert last[3].mem_b == pytest.approx(last[2].mem_b * 3 / 2, rel=1e-12)
