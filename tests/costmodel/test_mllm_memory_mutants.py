"""stp.costmodel.memory's multimodal path (`_estimate_mllm`): the cases the other
costmodel tests never set up.

Written to kill mutants mutmut left alive in stp/costmodel/memory.py (docs/testing.md;
the decoder's are in test_memory_mutants.py). The references: the parameters per
stage of stp.costmodel.mllm.memory summed by the placement, the receive buffers of
the decoder-wide stream by hand, the simulated step of the multimodal stage table.
Each test names the bug it guards against.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from stp.costmodel import parse_hardware
from stp.costmodel.memory import Features, Layout, estimate

HW = parse_hardware("a100-80g")
S, B = 16, 3


def _refused(call, message: str) -> None:
    """`call` raises ValueError with exactly `message`."""
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def _mllm(tp: int = 1):
    from stp.models.mllm.family import MLLM
    from stp.shapes import MLLMConfig, ModelConfig, VisionConfig

    vision = VisionConfig(image_size=16, patch_size=4, hidden=16, num_layers=2, num_heads=4)
    decoder = ModelConfig(vocab_size=81, hidden=64, num_layers=4, num_heads=4, num_kv_heads=2,
                          ffn_hidden=176, max_seq_len=vision.image_tokens + S, seed=1)
    return MLLM.cost_spec(MLLMConfig(vision, decoder), sequence=S, micro_batch=B, tp=tp)


MLLM_LAYOUT = Layout(pp=2, tp=2, microbatches=4, microbatch_size=B, seq_len=S, schedule="zb-v")


@pytest.mark.parametrize("runtime", ["stp", "megatron"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_multimodal_rank_holds_its_stages_parameters_and_the_packed_stream_buffers(
        runtime: str, dtype: str) -> None:
    """A multimodal model on a V placement (stages 0 and 3 on rank 0): each rank's
    parameters are its stages' (stp.costmodel.mllm.memory, stp's encoder or
    Qwen2-VL's), its weights those times the dtype's bytes, its buffers the receive
    buffers of the decoder-wide stream (text and image tokens) with sequence
    parallelism's / t and gathered input; the layout it reports carries the
    partition it priced. Kills: the stage-to-rank sum, the runtime flag, the
    stream's length, the layout's partition or ep, the dtype's width."""
    from stp.costmodel.mllm.memory import mllm_stage_parameters
    from stp.sim.layered import even_partition

    spec = _mllm(tp=2)
    est = estimate(spec, HW, MLLM_LAYOUT, Features(dtype=dtype, runtime=runtime,
                                                   sequence_parallel=True))
    counts = tuple(even_partition(spec.total_layers, 4))
    stage = mllm_stage_parameters(replace(spec, tp=2), counts, stp_runtime=runtime == "stp")
    want = [stage[0] + stage[3], stage[1] + stage[2]]
    width = 4 if dtype == "float32" else 2
    assert [r.parameters for r in est.ranks] == want
    assert [r.weights for r in est.ranks] == [width * n for n in want]
    values = spec.decoder_sequence * B * 64 * width
    for r in est.ranks:
        assert r.buffers == 2 * 2 * values / 2 + 2 * values
    assert est.layout == replace(MLLM_LAYOUT, partition=counts, ep=None)


def test_a_multimodal_estimate_notes_what_it_does_not_count() -> None:
    """stp's units with sequence parallelism at tp > 1: the encoder's kept bytes are
    derived (noted); at tp 1 there is none to note. Korthikanti's formulas count
    neither sequence parallelism nor recomputation (noted whenever one is on).
    Kills: the notes' text, `tp > 1` as >= 1, the megatron note's `or` as `and` or
    its recompute test inverted."""
    derived = ("with sequence parallelism the vision encoder's kept bytes are derived, not "
               "census-checked (stp.costmodel.mllm.memory)",)
    formulas = ("the multimodal model's activation formulas (stp.costmodel.mllm) count "
                "neither sequence parallelism nor recomputation",)
    one = replace(MLLM_LAYOUT, tp=1)

    def notes(layout: Layout, **features) -> tuple[str, ...]:
        tp = layout.tp
        return estimate(_mllm(tp=tp), HW, layout, Features(**features)).notes

    assert notes(MLLM_LAYOUT, runtime="stp", sequence_parallel=True) == derived
    assert notes(one, runtime="stp", sequence_parallel=True) == ()
    assert notes(MLLM_LAYOUT, runtime="stp") == ()
    assert notes(MLLM_LAYOUT, sequence_parallel=True) == formulas
    assert notes(one, sequence_parallel=True) == ()
    assert notes(MLLM_LAYOUT, recompute="selective") == formulas
    assert notes(MLLM_LAYOUT) == ()


def test_a_multimodal_model_refuses_ep_and_too_few_layers() -> None:
    """Kills: the refusals' text, ep=1 refused, the layer count (vision + decoder)
    compared with the stages the wrong way."""
    spec = _mllm()
    _refused(lambda: estimate(spec, HW, Layout(pp=2, dp=2, ep=2, seq_len=S)),
             f"ep=2: expert parallelism needs a mixture-of-experts model; {spec.name} has no "
             "experts")
    assert estimate(spec, HW, Layout(pp=2, dp=2, ep=1, seq_len=S)).ranks
    _refused(lambda: estimate(spec, HW, Layout(pp=4, microbatches=4, seq_len=S,
                                               schedule="zb-v")),
             "the model's 2 vision + 4 decoder layers cannot fill 8 stages of zb-v at pp=4")
    # six layers fill six stages exactly
    assert estimate(spec, HW, Layout(pp=3, microbatches=3, seq_len=S, schedule="zb-v")).ranks


SLOW_LINK = replace(HW, host_bandwidth=2e6)
"""A host link slow enough (2 kB/ms) that a tiny model's offload copies take time."""


def _mllm_reference_peaks(spec, layout: Layout, features: Features, counts,
                          hw) -> list[float]:
    """Each rank's activation peak in bytes as docs/memory.md states it: the simulated
    step of the multimodal stage table (stp's kept bytes, or Qwen2-VL's costs with
    Korthikanti's 16-bit bytes scaled by the dtype), offloaded by the policy over
    the host link (bandwidth in bytes per ms)."""
    from stp.costmodel.memory_types import DTYPE_BYTES
    from stp.costmodel.mllm.costs import derive_mllm, mllm_layered_costs
    from stp.costmodel.mllm.memory import mllm_stp_table
    from stp.schedule.registry import generate
    from stp.sim.costs import OffloadCosts
    from stp.sim.engine import simulate
    from stp.sim.offload import plan_offload

    spec = replace(spec, tp=layout.tp, sequence=layout.seq_len,
                   micro_batch=layout.microbatch_size)
    sch = generate(layout.schedule, layout.pp, layout.microbatches)
    width = DTYPE_BYTES[features.dtype]
    if features.runtime == "stp":
        table, mem, unit, derived = mllm_stp_table(
            spec, hw, layout.pp, width, counts, recompute=features.recompute,
            sequence_parallel=features.sequence_parallel and layout.tp > 1)
    else:
        derived = derive_mllm(spec, hw, layout.pp)
        layered = mllm_layered_costs(spec, hw, layout.pp, derived.costs, derived.mem)
        table = layered.table(counts)
        mem, unit = derived.mem, derived.bytes_per_unit * width / 2
    oc = OffloadCosts(bandwidth=hw.host_bandwidth / 1e3, act_bytes=unit)
    plan = plan_offload(sch, features.offload, derived.costs, mem, oc, stages=table)
    res = simulate(sch, derived.costs, mem, offload=plan if len(plan) else None,
                   offload_costs=oc, stages=table)
    return [r.peak_activation * unit for r in res.ranks]


@pytest.mark.parametrize("features,hw", [
    (Features(runtime="stp", offload="all"), SLOW_LINK),
    (Features(runtime="stp", dtype="float32", sequence_parallel=True, recompute="full"),
     SLOW_LINK),
    (Features(offload="all"), SLOW_LINK),
    (Features(offload="all"), HW),
    (Features(dtype="float32", offload="selective:0.5"), SLOW_LINK),
])
def test_multimodal_activations_are_the_simulated_peak_of_its_own_stage_table(
        features: Features, hw) -> None:
    """A multimodal rank's activations: the simulated peak of its stage table at the
    layout's sequence and microbatch size (not the spec's), with the policy's
    offload copies (the host link in bytes per ms; a slow and a fast one), in bytes of
    the dtype. Kills:
    the layout's sequence or microbatch size ignored, sequence parallelism or
    recomputation not passed to the table, the megatron table or unit's dtype
    scaling altered, the offload plan or its link (bandwidth / 1e3) altered, the
    plan dropped."""
    from stp.sim.layered import even_partition

    spec = _mllm()
    layout = Layout(pp=2, tp=2, microbatches=4, microbatch_size=2, seq_len=24, schedule="zb-v")
    counts = tuple(even_partition(spec.total_layers, 4))
    est = estimate(spec, hw, layout, features)
    want = _mllm_reference_peaks(spec, layout, features, counts, hw)
    assert [r.activations_peak for r in est.ranks] == pytest.approx(want, rel=1e-12)


def test_a_multimodal_estimate_runs_the_schedule_it_is_given_and_checks_the_partition() -> None:
    """A schedule handed in (1f1b, two stages) is the one priced, not the layout's
    generated zb-v (four stages): rank 0 then holds the first half of the layers
    only. A partition that does not sum to the model's layers is refused. Kills:
    the given schedule ignored, the partition's sum left unchecked."""
    from stp.costmodel.mllm.memory import mllm_stage_parameters
    from stp.schedule.registry import generate

    spec = _mllm()
    layout = Layout(pp=2, microbatches=4, microbatch_size=B, seq_len=S, schedule="zb-v")
    est = estimate(spec, HW, layout, schedule=generate("1f1b", 2, 4))
    assert [r.parameters for r in est.ranks] == mllm_stage_parameters(
        spec, (3, 3), stp_runtime=False)
    _refused(lambda: estimate(spec, HW, replace(layout, partition=(1, 1, 1, 1))),
             "--partition 1,1,1,1 sums to 4 layers but the model has 6; the stages must "
             "hold every layer once")


def test_a_multimodal_estimate_under_korthikanti_notes_a_deferred_w_after_recomputation() -> None:
    """Korthikanti's counting, full recomputation, a schedule that defers W: both
    the decoder's note (its recompute passed on) and the multimodal formulas' note,
    in that order; ep 1 is reported as None (no expert parallelism). Kills: the
    decoder spec built without the recompute mode, the notes' order, the layout's
    ep kept."""
    spec = _mllm()
    est = estimate(spec, HW, replace(MLLM_LAYOUT, ep=1, tp=1), Features(recompute="full"))
    assert est.notes == (
        "zb-v defers W: full recomputation's inputs kept for a deferred W are not counted "
        "(stp.costmodel.decoder.spec)",
        "the multimodal model's activation formulas (stp.costmodel.mllm) count neither "
        "sequence parallelism nor recomputation")
    assert est.layout.ep is None


def test_sequence_parallelism_and_recomputation_lower_a_multimodal_peak() -> None:
    """Under stp's units (what the runtime keeps) both cut the kept bytes: the
    peak with sequence parallelism at tp 2 is below the one without, full
    recomputation's below none's. Kills: either not passed to the stage table."""
    spec = _mllm(tp=2)

    def peak(**features) -> float:
        return estimate(spec, HW, MLLM_LAYOUT, Features(runtime="stp", **features)
                        ).peak.activations_peak

    plain = peak()
    assert peak(sequence_parallel=True) < plain
    assert peak(recompute="full") < plain
