"""Rotary position embeddings against their closed form, without transformers.

RoFormer (arXiv 2104.09864) turns each pair of a head's coordinates by the
angle position * frequency; in the rotate-half layout of transformers' Llama
and Qwen2 the pairs are (x_j, x_{j + d/2}), not neighbours, and the turn is
counter-clockwise: (a, b) -> (a cos - b sin, a sin + b cos). Two consequences
checked here from that form alone, for the units' code (stp.models.decoder.rope) and
for the single-process reference's own (stp.models.decoder.reference):

- a unit vector on coordinate j at position t lands on (cos t w_j, sin t w_j)
  at coordinates (j, j + d/2);
- q at position m dotted with k at position n is a function of m - n only,
  the real part of sum_j (q_j + i q_{j+d/2}) conj(k_j + i k_{j+d/2})
  exp(i (m - n) w_j) (so the sign of the turn is seen, not only its size).

The frequencies are theta^(-2j/d); Llama 3.1's scaling keeps wavelengths
below original / high_freq_factor, divides the frequency of those above
original / low_freq_factor by `factor`, and blends linearly in
original / wavelength in between (continuous at both edges).
The last test also compares with transformers when it is installed.
"""

from __future__ import annotations

import math

import pytest
import torch

from stp.models.decoder.reference import rope_frequencies, rotate
from stp.models.decoder.rope import RopeCache, _llama3_scaled, apply_rope, inverse_frequencies
from stp.shapes.decoder import RopeScaling

D = torch.float64
LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def closed_form_frequencies(d: int, theta: float, scaling: RopeScaling | None) -> list[float]:
    freqs = [1.0 / theta ** (2 * j / d) for j in range(d // 2)]
    if scaling is None:
        return freqs
    old, lo, hi, k = (scaling.original_max_position_embeddings, scaling.low_freq_factor,
                      scaling.high_freq_factor, scaling.factor)
    out = []
    for f in freqs:
        ratio = old * f / (2 * math.pi)  # original length / wavelength
        if ratio > hi:
            out.append(f)
        elif ratio < lo:
            out.append(f / k)
        else:
            w = (ratio - lo) / (hi - lo)  # 0 at the low edge, 1 at the high edge
            out.append(f * (w + (1 - w) / k))
    return out


def stp_rotate(x: torch.Tensor, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    cos, sin = RopeCache(x.shape[-1], theta, scaling).get(x.shape[-2], x.device, x.dtype)
    return apply_rope(x, cos, sin)


def reference_rotate(x: torch.Tensor, theta: float, scaling: RopeScaling | None
                     ) -> torch.Tensor:
    return rotate(x, rope_frequencies(x.shape[-1], theta, scaling))


IMPLS = {"units": stp_rotate, "reference": reference_rotate}
SETTINGS = [(10000.0, None), (500000.0, LLAMA31), (7.0, None)]


@pytest.mark.parametrize("theta, scaling", SETTINGS, ids=["plain", "llama3", "theta7"])
def test_frequencies_follow_the_closed_form(theta, scaling) -> None:
    d = 128
    want = torch.tensor(closed_form_frequencies(d, theta, scaling), dtype=D)
    torch.testing.assert_close(inverse_frequencies(d, theta, scaling), want, rtol=1e-13, atol=0)
    torch.testing.assert_close(torch.tensor(rope_frequencies(d, theta, scaling), dtype=D), want,
                               rtol=1e-13, atol=0)


def test_llama3_scaling_keeps_high_divides_low_and_is_continuous() -> None:
    d, theta = 128, 500000.0
    plain = inverse_frequencies(d, theta)
    scaled = inverse_frequencies(d, theta, LLAMA31)
    wavelength = 2 * math.pi / plain
    short = wavelength < 8192 / 4
    long = wavelength > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()  # all three bands occur
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8, rtol=1e-15, atol=0)
    # At the band edges (and just inside them) the blend meets the neighbouring rule.
    for edge, want in ((8192 / 4, 1.0), (8192 / 1, 1 / 8)):
        f = torch.tensor([2 * math.pi / edge * (1 + e) for e in (0, 1e-9, -1e-9)], dtype=D)
        torch.testing.assert_close(_llama3_scaled(f, LLAMA31) / f,
                                   torch.full_like(f, want), rtol=1e-8, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("theta, scaling", SETTINGS, ids=["plain", "llama3", "theta7"])
def test_a_unit_vector_turns_counter_clockwise_in_rotate_half_pairs(impl, theta, scaling):
    d, s = 16, 9
    freqs = closed_form_frequencies(d, theta, scaling)
    for j in (0, 3, d // 2 - 1):
        x = torch.zeros(1, 1, s, d, dtype=D)
        x[..., j] = 1.0
        got = IMPLS[impl](x, theta, scaling)[0, 0]
        want = torch.zeros(s, d, dtype=D)
        for t in range(s):
            want[t, j] = math.cos(t * freqs[j])
            want[t, j + d // 2] = math.sin(t * freqs[j])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("theta, scaling", SETTINGS, ids=["plain", "llama3", "theta7"])
def test_scores_depend_on_the_signed_offset_only(impl, theta, scaling) -> None:
    d, s = 32, 12
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(d, generator=gen, dtype=D), torch.randn(d, generator=gen, dtype=D)
    rq = IMPLS[impl](q.expand(1, 1, s, d), theta, scaling)[0, 0]
    rk = IMPLS[impl](k.expand(1, 1, s, d), theta, scaling)[0, 0]
    scores = rq @ rk.T  # [m, n]
    h = d // 2
    zq = torch.complex(q[:h], q[h:])
    zk = torch.complex(k[:h], k[h:])
    w = torch.tensor(closed_form_frequencies(d, theta, scaling), dtype=D)
    for m in range(s):
        for n in range(s):
            turn = torch.polar(torch.ones_like(w), (m - n) * w)
            want = float((zq * zk.conj() * turn).real.sum())
            assert float(scores[m, n]) == pytest.approx(want, abs=1e-10), (m, n)
    assert not torch.allclose(scores, scores.T)  # the offset's sign matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_units_equal_the_reference_rotation(dtype) -> None:
    """Whole heads of random values, both layouts of the code, to rounding."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 64, generator=gen, dtype=D).to(dtype)
    for theta, scaling in SETTINGS:
        torch.testing.assert_close(stp_rotate(x, theta, scaling),
                                   reference_rotate(x, theta, scaling))


def test_matches_transformers_when_installed() -> None:
    """Layout and Llama 3 scaling as transformers computes them (the other tests
    do not need it)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=64,
                      rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
    emb = llama.LlamaRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 50, 64, generator=gen, dtype=D)
    pos = torch.arange(50)[None]
    cos, sin = emb(x, pos)
    want, _ = llama.apply_rotary_pos_emb(x, x, cos.to(D), sin.to(D))
    # transformers builds its tables in float32: agreement to float32 rounding.
    torch.testing.assert_close(stp_rotate(x, 500000.0, LLAMA31), want, rtol=0, atol=1e-4)
