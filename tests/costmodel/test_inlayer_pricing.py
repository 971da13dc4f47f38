"""In-layer TP overlap's cost-model inputs: chunk launch cost and chunk GEMM efficiency."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from stp.costmodel import parse_hardware
from stp.costmodel.decoder.memory import simulate_run
from stp.costmodel.hardware import HardwareSpec, allgather_time
from stp.costmodel.inlayer import chunk_launch_ms, in_layer_plan
from stp.costmodel.memory import Features, Layout
from stp.costmodel.presets import HARDWARE, MODELS


def test_chunk_launch_is_one_more_ring_call():
    """K chunked all-gathers of n/K bytes cost, by the alpha-beta model, the whole
    all-gather plus (K - 1) x (launch + (t - 1) alpha): L per extra call."""
    hw = HardwareSpec(peak_flops=1e15, tp_latency=4e-6, tp_chunk_launch=7e-6)
    t, n, k = 8, 96e6, 4
    whole = allgather_time(n, t, hw.tp_bandwidth, hw.tp_latency)
    pieces = k * (allgather_time(n / k, t, hw.tp_bandwidth, hw.tp_latency) + hw.tp_chunk_launch)
    extra_calls = (k - 1) * chunk_launch_ms(hw, t) / 1e3
    assert pieces == pytest.approx(whole + extra_calls + hw.tp_chunk_launch)
    assert chunk_launch_ms(hw, t) == pytest.approx((7e-6 + 7 * 4e-6) * 1e3)
    assert chunk_launch_ms(hw, 1) == pytest.approx(7e-3)


def test_gemm_efficiency_interpolates_in_log_rows():
    hw = HardwareSpec(peak_flops=1e15, gemm_rows=((256.0, 0.5), (1024.0, 0.9), (4096.0, 1.0)))
    assert hw.gemm_efficiency(100) == 0.5  # held below the first point
    assert hw.gemm_efficiency(512) == pytest.approx(0.7)  # halfway in log2 rows
    assert hw.gemm_efficiency(2048) == pytest.approx(0.95)
    assert hw.gemm_efficiency(1 << 20) == 1.0
    # a chunk of 8192 / 8 = 1024 rows against the whole 8192 rows
    assert hw.chunk_efficiency(8192, 8) == pytest.approx(0.9)
    assert hw.chunk_efficiency(8192, 1) == 1.0
    plan = in_layer_plan(hw, 8, 8192, 8)
    assert (plan.chunks, plan.efficiency) == (8, pytest.approx(0.9))


def test_gemm_rows_text_and_bad_values():
    hw = parse_hardware("h100-80g,gemm_rows=512:0.8/4096:1,tp_chunk_launch=2e-5")
    assert hw.gemm_rows == ((512.0, 0.8), (4096.0, 1.0))
    assert hw.tp_chunk_launch == 2e-5
    for bad in ("512:1.5", "512", "4096:1/512:0.8", "x:0.5", "0:0.5"):
        with pytest.raises(ValueError, match="gemm_rows"):
            parse_hardware(f"h100-80g,gemm_rows={bad}")


def test_presets_carry_the_assumed_curve():
    for name in ("h100-80g", "h200-141g"):
        hw = HARDWARE[name]
        assert hw.gemm_efficiency(8192) == 1.0 and hw.gemm_efficiency(512) < 0.9
    assert HARDWARE["h200-141g"].memory > HARDWARE["h100-80g"].memory


def _run(features: Features, schedule: str = "zb-v"):
    spec = replace(MODELS["qwen2-12.1b"], sequence=6144)
    layout = Layout(pp=4, tp=8, dp=1, microbatches=8, microbatch_size=1, seq_len=6144,
                    schedule=schedule)
    return simulate_run(spec, HARDWARE["h100-80g"], layout, features)[1]


def test_simulate_run_prices_the_overlap_modes():
    """ZB-V has no braided block: in-layer overlap hides most of its exposed
    collectives; the plan's chunks reach the simulator."""
    sp = Features(sequence_parallel=True)
    plain = _run(sp)
    chunked = _run(replace(sp, tp_overlap_chunks=4))
    assert (plain.mode, chunked.mode) == ("braided", "both")
    assert chunked.in_layer is not None and chunked.in_layer.chunks == 4
    assert chunked.tp_bubble < 0.5 * plain.tp_bubble
    assert not math.isclose(chunked.makespan, plain.makespan)
    assert _run(replace(sp, braid=False), "stp").mode == "none"


def test_overlap_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="--tp-overlap needs --sequence-parallel"):
        Features(tp_overlap_chunks=4)
    with pytest.raises(ValueError, match="--tp-overlap-chunks"):
        Features(sequence_parallel=True, tp_overlap_chunks=-1)
