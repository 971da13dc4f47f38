"""The counter-based initial values (stp.models.counter_rng) against a plain-Python
SplitMix64 + Box-Muller written from the module's documentation, and the property
the parity tests rely on: any slice, computed alone, equals the same rows of the
whole tensor (so every mesh holds the same model)."""

from __future__ import annotations

import math

import pytest
import torch

from stp.models import ModelConfig, counter_rng
from stp.models.counter_rng import normal_slice, splitmix_key
from stp.models.decoder.init import init_full, init_shard, parameter_specs

MASK = (1 << 64) - 1


def reference(key: int, i: int) -> float:
    """Element i: component i % 2 of pair i // 2 (SplitMix64 output for counter
    pair + 1, Steele, Lea and Flood's constants), Box-Muller, in Python floats."""
    z = ((i // 2 + 1) * 0x9E3779B97F4A7C15 + (key & MASK)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    u1 = ((z >> 32) + 1) / 2.0 ** 32
    theta = 2.0 * math.pi * (z & 0xFFFFFFFF) / 2.0 ** 32
    r = math.sqrt(-2.0 * math.log(u1))
    return r * (math.sin(theta) if i % 2 else math.cos(theta))


@pytest.mark.parametrize("shape", [(13, 7), (6, 10), (33,)])
def test_values_match_the_plain_python_generator(shape):
    key = splitmix_key(0xDEADBEEF12345678)
    got = normal_slice(key, shape, None, 0, 0).flatten().tolist()
    want = [reference(key, i) for i in range(math.prod(shape))]
    # float32 rounding of a float64 value: equal to a relative 2**-23
    assert got == pytest.approx(want, rel=2e-7, abs=1e-7)


@pytest.mark.parametrize("shape", [(12, 10), (9, 7), (4, 6, 5), (11,)])
def test_a_slice_alone_equals_the_rows_of_the_whole(shape, monkeypatch):
    monkeypatch.setattr(counter_rng, "CPU_CHUNK_PAIRS", 8)  # many chunks, odd edges
    key = splitmix_key(7)
    whole = normal_slice(key, shape, None, 0, 0)
    for dim, size in enumerate(shape):
        for start, stop in ((0, size), (1, size), (0, size // 2), (size // 3, size - 1)):
            if stop > start:
                part = normal_slice(key, shape, dim, start, stop)
                assert torch.equal(part, whole.narrow(dim, start, stop - start)), (dim, start)


def test_draws_are_standard_normal():
    x = normal_slice(splitmix_key(3), (512, 256), None, 0, 0).double()
    n = x.numel()
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert abs(x.std().item() - 1) < 5 / math.sqrt(2 * n)
    inside = (x.abs() < 1).double().mean().item()  # 68.27% within one std
    assert abs(inside - 0.6827) < 5 * math.sqrt(0.6827 * 0.3173 / n)
    # neighbours (the two halves of a pair, and successive pairs) are uncorrelated
    flat = x.flatten()
    assert abs((flat[0::2] * flat[1::2]).mean().item()) < 5 / math.sqrt(n / 2)
    assert abs((flat[:-2] * flat[2:]).mean().item()) < 5 / math.sqrt(n)


def test_every_tp_rank_makes_only_its_rows_of_the_seeded_model():
    cfg = ModelConfig(vocab_size=50, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden=64, max_seq_len=16, seed=5)
    for spec in parameter_specs(cfg):
        full = init_full(cfg, spec, torch.float32)
        for tp in (2, 4):
            parts = [init_shard(cfg, spec, tp, r) for r in range(tp)]
            if spec.shard_dim is None:
                assert all(torch.equal(p, full) for p in parts)
                continue
            kept = sum(p.shape[spec.shard_dim] for p in parts)
            # each rank's slice is exactly its rows of the whole tensor (the padded
            # vocabulary ends in zero rows; replicated kv heads repeat)
            if spec.tp_split == "even":
                assert torch.equal(torch.cat(parts, spec.shard_dim), full), spec.name
            assert kept >= spec.shape[spec.shard_dim]


def test_seed_and_name_change_the_values():
    cfg = ModelConfig(vocab_size=50, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden=64, max_seq_len=16, seed=5)
    other = ModelConfig(vocab_size=50, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden=64, max_seq_len=16, seed=6)
    wq0, wq1 = (s for s in parameter_specs(cfg) if s.name.endswith("attn.wq.weight"))
    assert not torch.equal(init_full(cfg, wq0, torch.float32), init_full(cfg, wq1, torch.float32))
    assert not torch.equal(init_full(cfg, wq0, torch.float32),
                           init_full(other, wq0, torch.float32))
