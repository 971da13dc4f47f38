"""Recomputation and sequence parallelism in the per-layer formulas
(Korthikanti et al., arXiv 2205.05198, Table 2), and a search that only fits
with recomputation finds it."""

from dataclasses import replace

import pytest

from stp.costmodel import ModelSpec, parse_hardware
from stp.costmodel.decoder.spec import layer_activation_bytes, layer_flops
from stp.search.recompute import mode_costs, search_recompute

S, B, H, A, T = 2048, 2, 1024, 16, 4
GPT = ModelSpec(layers=8, hidden=H, heads=A, kv_heads=A, ffn=4 * H, vocab=1000, sequence=S,
                micro_batch=B, tp=T, gated_mlp=False)
"""GPT-shaped (k = a, f = 4h, GELU): the paper's formulas hold term for term."""


def _m_b(**kw) -> float:
    return layer_activation_bytes(replace(GPT, **kw))[0]


def test_the_papers_table():
    sbh = S * B * H
    assert _m_b() == pytest.approx(sbh * (10 + 24 / T + 5 * A * S / (H * T)))
    assert _m_b(sequence_parallel=True) == pytest.approx(sbh / T * (34 + 5 * A * S / H))
    assert _m_b(sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / T)
    assert _m_b(sequence_parallel=True, recompute="full") == pytest.approx(2 * sbh / T)
    assert _m_b(recompute="full") == pytest.approx(2 * sbh)


def test_selective_removes_the_score_term_and_recomputes_the_core():
    assert _m_b() - _m_b(recompute="selective") == pytest.approx(5 * A * S * S * B / T)
    f0, b0, w0 = layer_flops(GPT)
    f1, b1, w1 = layer_flops(replace(GPT, recompute="selective"))
    assert (f1, w1) == (f0, w0)
    assert b1 - b0 == pytest.approx(4 * S * S * B * H / T)  # Q K^T and the weighted sum


def test_full_recomputes_the_whole_forward_in_b():
    f0, b0, w0 = layer_flops(GPT)
    _, b1, w1 = layer_flops(replace(GPT, recompute="full"))
    assert b1 == pytest.approx(b0 + f0) and w1 == w0
    m_b, m_w = layer_activation_bytes(replace(GPT, recompute="full"))
    assert m_w <= m_b


def test_flash_attention_makes_selective_a_no_op():
    flash = replace(GPT, flash_attention=True)
    assert layer_activation_bytes(replace(flash, recompute="selective")) == \
        layer_activation_bytes(flash)
    assert layer_flops(replace(flash, recompute="selective")) == layer_flops(flash)


def test_unknown_mode_refused():
    with pytest.raises(ValueError, match="recompute='some'"):
        replace(GPT, recompute="some")


def test_search_finds_recomputation_when_only_it_fits():
    """A limit below one microbatch's activations without recomputation (M_B = 1)
    cannot be met by any schedule without it; the search picks a mode that
    meets it and says so per stage."""
    spec = replace(GPT, layers=4, heads=16, sequence=4096)
    hw = parse_hardware("a100-80g")
    by_mode = mode_costs(spec, hw, 2)
    assert by_mode["none"][1].m_b == pytest.approx(1.0)
    limit = 0.9
    assert by_mode["selective"][1].m_b < limit
    got = search_recompute(spec, hw, 2, 4, memory_limit=limit, time_limit=1.0)
    assert got.tried["none"] is None
    assert set(got.modes) <= {"none", "selective", "full"}
    assert any(mode != "none" for mode in got.modes)
    assert max(got.result.result.peak_activation) <= limit + 1e-9


def test_search_refuses_a_limit_below_full_recomputation():
    spec = replace(GPT, layers=4)
    with pytest.raises(ValueError, match="below what full recomputation needs"):
        search_recompute(spec, parse_hardware("a100-80g"), 2, 4, memory_limit=1e-4,
                         time_limit=0.5)
