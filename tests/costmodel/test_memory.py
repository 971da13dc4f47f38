"""Bytes per rank (`stp.costmodel.memory`): model states per parameter, ZeRO
stage 1's division by dp, activations from the simulator, the peak rank."""

from dataclasses import replace

import pytest

from stp.costmodel import MODELS, ModelSpec, num_parameters, parse_hardware
from stp.costmodel.budget import over_budget, parse_size
from stp.costmodel.configs import spec_from_config, spec_from_hf_json
from stp.costmodel.decoder.costs import derive_decoder
from stp.costmodel.memory import Features, Layout, estimate
from stp.shapes import ModelConfig

HW = parse_hardware("a100-80g")
SPEC = ModelSpec(layers=8, hidden=512, heads=8, kv_heads=8, ffn=1536, vocab=1024, sequence=256)
LAYOUT = Layout(pp=2, tp=2, dp=4, microbatches=8, seq_len=256, schedule="zb-v")


def test_states_per_parameter_bfloat16_and_float32():
    """bf16: 2 (weights) + 4 (fp32 gradient buffer) + 4 (masters) + 8 (moments);
    float32 keeps no masters."""
    for r in estimate(SPEC, HW, LAYOUT).ranks:
        assert (r.weights, r.grads, r.masters, r.optimizer) == \
            (2 * r.parameters, 4 * r.parameters, 4 * r.parameters, 8 * r.parameters)
    for r in estimate(SPEC, HW, LAYOUT, Features(dtype="float32")).ranks:
        assert (r.weights, r.grads, r.masters, r.optimizer) == \
            (4 * r.parameters, 4 * r.parameters, 0, 8 * r.parameters)


def test_sharded_optimizer_divides_masters_and_moments_by_dp():
    plain = estimate(SPEC, HW, LAYOUT).ranks
    sharded = estimate(SPEC, HW, LAYOUT, Features(shard_optimizer=True,
                                                  overlap_grad_sync=False)).ranks
    for a, b in zip(plain, sharded, strict=True):
        assert b.masters == a.masters / 4 and b.optimizer == a.optimizer / 4
        assert b.weights == a.weights and b.grads == a.grads
        assert b.buffers == pytest.approx(a.buffers + 4 * a.parameters / 4)


def test_parameters_add_up_to_the_model():
    """Every rank's TP shard, times t, is the whole model (+ norms: 2h per layer
    and the final h, which num_parameters leaves out)."""
    ranks = estimate(SPEC, HW, LAYOUT).ranks
    total = sum(r.parameters for r in ranks) * LAYOUT.tp
    norms = (2 * SPEC.layers + 1) * SPEC.hidden * LAYOUT.tp
    assert total == num_parameters(SPEC) + norms


def test_activations_are_the_simulated_peak_in_bytes():
    est = estimate(SPEC, HW, LAYOUT)
    from stp.costmodel.stages import layered_costs
    from stp.schedule import generate
    from stp.sim import simulate
    from stp.sim.layered import even_partition

    spec = replace(SPEC, tp=2)
    d = derive_decoder(spec, HW, 2)
    sch = generate("zb-v", 2, 8)
    table = layered_costs(spec, HW, 2, d.costs, d.mem).table(even_partition(8, 4))
    res = simulate(sch, d.costs, d.mem, stages=table, record_spans=False)
    for r, got in zip(res.ranks, est.ranks, strict=True):
        assert got.activations_peak == pytest.approx(r.peak_activation * d.bytes_per_unit)


def test_sequence_parallel_and_recompute_lower_the_peak():
    base = estimate(SPEC, HW, LAYOUT).peak.activations_peak
    sp = estimate(SPEC, HW, LAYOUT, Features(sequence_parallel=True)).peak.activations_peak
    full = estimate(SPEC, HW, LAYOUT, Features(sequence_parallel=True, recompute="full"))
    assert full.peak.activations_peak < sp < base


def test_peak_rank_is_the_largest_total():
    est = estimate(MODELS["qwen2-12.1b"], HW, Layout(pp=2, tp=8, microbatches=8, seq_len=6144))
    assert est.peak.total == max(r.total for r in est.ranks)
    obj = est.to_json()
    assert obj["peak_rank"] == est.peak.rank
    assert set(obj["memory"]) >= {"weights", "grads", "masters", "optimizer",
                                  "activations_peak", "total"}


def test_sizes_and_budgets():
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("1234") == 1234
    for bad in ("80XB", "-1", "GB", "1e3", "８0GB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    est = estimate(SPEC, HW, LAYOUT)
    assert over_budget(est, est.peak.total) is None
    line = over_budget(est, est.peak.total - 1)
    assert line is not None and f"rank {est.peak.rank}" in line and est.peak.largest in line


def test_specs_from_configs():
    cfg = ModelConfig(vocab_size=1000, hidden=256, num_layers=4, num_heads=4, num_kv_heads=2)
    spec = spec_from_config(cfg, seq_len=128, tp=2)
    assert (spec.layers, spec.hidden, spec.kv_heads, spec.ffn, spec.tp) == (4, 256, 2,
                                                                              cfg.ffn, 2)
    hf = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
    got = spec_from_hf_json(hf, "config.json")
    assert (got.hidden, got.layers, got.heads, got.kv_heads, got.ffn) == (896, 24, 14, 2, 4864)
    with pytest.raises(ValueError, match="hidden_size"):
        spec_from_hf_json({**hf, "hidden_size": "x"}, "config.json")


def test_published_presets():
    assert num_parameters(MODELS["qwen2-72b"]) == pytest.approx(72.7e9, rel=0.01)
    assert num_parameters(MODELS["llama3-405b"]) == pytest.approx(405.8e9, rel=0.01)
    assert parse_hardware("h100-80g").memory == 81559 * 2**20


def test_a_run_config_is_estimated_as_its_spec():
    """`estimate` takes the ModelConfig a run builds (the entry point `stp train`
    flags can reach) and prices it as a decoder without dropout."""
    cfg = ModelConfig(vocab_size=1024, hidden=512, num_layers=8, num_heads=8, num_kv_heads=8,
                      ffn_hidden=1536)
    from_config = estimate(cfg, HW, LAYOUT)
    from_spec = estimate(replace(SPEC, dropout=False, flash_attention=True), HW, LAYOUT)
    assert from_config.to_json()["ranks"] == from_spec.to_json()["ranks"]
    # a multimodal spec is estimated too (stp.costmodel.mllm.memory): its TP shards
    # hold the encoder, merger and decoder's weights (norm gains aside)
    from stp.costmodel import MLLM_MODELS
    from stp.costmodel.decoder.spec import num_parameters
    from stp.costmodel.mllm.spec import decoder_view, vision_parameters

    mllm = replace(next(iter(MLLM_MODELS.values())), tp=1)
    held = sum(r.parameters for r in estimate(mllm, HW, LAYOUT).ranks) * LAYOUT.tp
    whole = vision_parameters(mllm) + num_parameters(decoder_view(mllm))
    assert held == pytest.approx(whole, rel=1e-3)


def test_dropout_masks_are_what_the_formula_adds():
    """Korthikanti's 10h replicated bytes hold two 1-byte masks (2h) and the
    5 a s^2 b scores term one mask (a s^2 b)."""
    from stp.costmodel.decoder.spec import layer_activation_bytes

    s, b, h, a, t = SPEC.sequence, SPEC.micro_batch, SPEC.hidden, SPEC.heads, 2
    spec = replace(SPEC, tp=t)
    with_masks = layer_activation_bytes(spec)[0]
    without = layer_activation_bytes(replace(spec, dropout=False))[0]
    assert with_masks - without == pytest.approx(2 * s * b * h + a * s * s * b / t)


def test_an_explicit_partition_moves_the_parameters():
    even = estimate(SPEC, HW, LAYOUT).ranks
    uneven = estimate(SPEC, HW, replace(LAYOUT, partition=(1, 3, 3, 1))).ranks
    assert uneven[0].parameters < even[0].parameters  # zb-v: rank 0 holds stages 0 and 3
    assert sum(r.parameters for r in uneven) == sum(r.parameters for r in even)
    with pytest.raises(ValueError, match="sums to 7"):
        estimate(SPEC, HW, replace(LAYOUT, partition=(1, 3, 2, 1)))


def _extra(est_on, est_dp1):
    return [a.buffers - b.buffers for a, b in zip(est_on.ranks, est_dp1.ranks, strict=True)]


def test_dp_reduction_copies_at_the_drain_add_what_exceeds_the_activations():
    """1F1B, one stage per rank, float32: its reduction's flat copy (4 bytes a
    parameter) comes as the last backward ends, activations freed, overlap or not:
    it adds what it exceeds the activations' peak by, to the byte (rank 1 holds the
    output layer: its copy is the larger). bf16 without the sharded optimizer: the
    fp32 main grads are reduced in place, nothing is added."""
    spec = replace(SPEC, sequence=128)  # float32's activations twice bf16's
    dp1 = replace(LAYOUT, dp=1, schedule="1f1b", seq_len=128)
    fp32 = Features(dtype="float32")
    base = estimate(spec, HW, dp1, fp32)
    for overlap in (True, False):
        est = estimate(spec, HW, replace(dp1, dp=4), replace(fp32, overlap_grad_sync=overlap))
        want = [max(0.0, 4 * r.parameters - r.activations_peak) for r in base.ranks]
        assert _extra(est, base) == pytest.approx(want, abs=1)
        assert want[1] > 0 and want[0] == 0  # both cases of the max taken
        assert all(r.copies == pytest.approx(w, abs=1) for r, w in zip(est.ranks, want,
                                                                       strict=True))
    base = estimate(spec, HW, dp1)
    for overlap in (True, False):
        est = estimate(spec, HW, replace(dp1, dp=4), Features(overlap_grad_sync=overlap))
        assert _extra(est, base) == [0.0, 0.0] and all(r.copies == 0 for r in est.ranks)
    # sharded, float32: the packed copy, and with the overlap the stage's
    # reduce-scattered segment (P / dp) too, besides the shard of the drain's
    # reduction (4 P / dp); bf16: the main grads are packed already, only each
    # stage's segment is held, overlap or not
    base32 = estimate(spec, HW, dp1, fp32)
    for dtype, overlap, packed, segment in (("float32", True, 1, 1), ("float32", False, 1, 0),
                                            ("bfloat16", True, 0, 1),
                                            ("bfloat16", False, 0, 1)):
        est = estimate(spec, HW, replace(dp1, dp=4), Features(
            dtype=dtype, overlap_grad_sync=overlap, shard_optimizer=True))
        ref = base32 if dtype == "float32" else base
        want = [4 * r.parameters / 4 + max(0.0, 4 * r.parameters * (packed + segment / 4)
                                           - r.activations_peak) for r in ref.ranks]
        assert _extra(est, ref) == pytest.approx(want, abs=1), (dtype, overlap)
        assert (sum(want) > sum(4 * r.parameters / 4 for r in ref.ranks)) == (dtype == "float32")


def test_overlapped_copies_are_held_from_their_stage_final():
    """ZB-V, float32: rank 0 holds stages 0 and 3, and stage 3's gradients are final first; with
    the overlap its copy is held under stage 0's last backwards, counted in buffers
    as what it adds to the activations' peak (to the byte); off, every copy comes
    after the drain."""
    from stp.costmodel.decoder.memory import rank_parameters
    from stp.costmodel.memory import estimate_run

    spec = replace(SPEC, vocab=16384, sequence=128)  # float32's activations twice bf16's
    layout = replace(LAYOUT, dp=4, seq_len=128)
    fp32 = Features(dtype="float32")
    base = estimate(spec, HW, replace(layout, dp=1), fp32)
    est, res = estimate_run(spec, HW, layout, replace(fp32, overlap_grad_sync=True))
    off = estimate(spec, HW, layout, replace(fp32, overlap_grad_sync=False))
    per_stage = rank_parameters(replace(spec, tp=2), 4, (0, 1, 2, 3), (2, 2, 2, 2))
    scale = base.ranks[0].activations_peak / res.ranks[0].peak_activation
    final = res.ranks[0].grads_final
    assert final[3] < final[0]
    best = 0.0
    for t, acts in res.memory[0]:
        held = sum(4 * per_stage[s] for s in (0, 3) if final[s] <= t)
        if held:
            best = max(best, acts * scale + held)
    want = max(0.0, best - base.ranks[0].activations_peak)
    assert want > 0
    assert _extra(est, base)[0] == pytest.approx(want, abs=1)
    want_off = max(0.0, 4 * base.ranks[0].parameters - base.ranks[0].activations_peak)
    assert _extra(off, base)[0] == pytest.approx(want_off, abs=1)
    assert want >= want_off - 1  # to the byte


def test_a_copy_held_under_later_activations_adds_to_their_peak():
    """A copy launched while activations are still resident counts from then: stage 3's
    copy (3 bytes) at t=2 over 5 bytes of activations gives 8, above the peak 6 and
    above both copies at the end (3 + 1): 2 bytes added; off, only the end's 4 (below
    6) and nothing added."""
    from types import SimpleNamespace

    from stp.costmodel.dp_copies import copies_over_peak

    rank = SimpleNamespace(grads_final={3: 2.0, 0: 4.0}, peak_activation=6.0)
    res = SimpleNamespace(memory=[[(0.0, 0.0), (1.0, 6.0), (2.0, 5.0), (4.0, 0.0)]],
                          ranks=[rank])
    copies = {0: 1.0, 3: 3.0}
    assert copies_over_peak(res, 0, copies, 1.0, True) == 2.0
    assert copies_over_peak(res, 0, copies, 1.0, False) == 0.0
    assert copies_over_peak(res, 0, {}, 1.0, True) == 0.0
