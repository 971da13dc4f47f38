"""The estimate of a run with full recomputation and a deferred W prices what the
runtime keeps between B and W (stp.costmodel.decoder.kept): B rebuilds each unit and
leaves its deferred W the (x, dy) of every matrix, as without recomputation,
many times the unit input F kept. On one stage running F, B, then W (zb-h1 at
pp 1, one microbatch) the peak is therefore the B-to-W bytes of the census
formulas, not the F-to-B bytes; with W inside B (1f1b) it stays the F-to-B bytes.
"""

from dataclasses import replace

import pytest

from stp.costmodel import ModelSpec, parse_hardware
from stp.costmodel.decoder.kept import stp_kept
from stp.costmodel.memory import DTYPE_BYTES, Features, Layout, estimate

HW = parse_hardware("a100-80g")
SPEC = ModelSpec(layers=4, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=320, sequence=128)


def _spec(tp: int, sp: bool) -> ModelSpec:
    return replace(SPEC, tp=tp, micro_batch=2, sequence_parallel=sp, recompute="full")


def _peak(schedule: str, tp: int, sp: bool, dtype: str) -> float:
    layout = Layout(pp=1, tp=tp, microbatches=1, microbatch_size=2, seq_len=128,
                    schedule=schedule)
    features = Features(dtype=dtype, sequence_parallel=sp, recompute="full", runtime="stp")
    return estimate(SPEC, HW, layout, features).peak.activations_peak


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
def test_a_deferred_w_keeps_its_inputs_after_a_recomputed_b(tp: int, sp: bool,
                                                            dtype: str) -> None:
    k = stp_kept(_spec(tp, sp), DTYPE_BYTES[dtype])
    kept_b = SPEC.layers * k.layer_b + k.first_b + k.last_b
    kept_w = SPEC.layers * k.layer_w + k.first_w + k.last_w
    assert kept_w > 5 * kept_b  # what the estimate missed before
    assert _peak("zb-h1", tp, sp, dtype) == pytest.approx(kept_w, rel=1e-9)


def test_with_w_inside_b_the_peak_is_what_f_kept() -> None:
    k = stp_kept(_spec(2, True), 2, native_weights=True)
    kept_b = SPEC.layers * k.layer_b + k.first_b + k.last_b
    assert _peak("1f1b", 2, True, "bfloat16") == pytest.approx(kept_b, rel=1e-9)


def test_b_to_w_bytes_are_those_without_recomputation() -> None:
    for tp, sp in ((1, False), (2, True)):
        full, none = stp_kept(_spec(tp, sp), 2), stp_kept(replace(_spec(tp, sp),
                                                                  recompute="none"), 2)
        assert (full.layer_w, full.first_w, full.last_w) == (none.layer_w, none.first_w,
                                                              none.last_w)
        assert full.layer_b < none.layer_b / 5 and full.last_b < none.last_b
