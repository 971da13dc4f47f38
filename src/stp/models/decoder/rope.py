"""Rotary position embeddings (Su et al. 2021, "RoFormer", arXiv 2104.09864) in the
rotate-half layout of Llama and Qwen2 as transformers computes them, with the
optional Llama 3 frequency scaling.

The frequency tables are computed in float64 and cast once per (length, device,
dtype): a float64 model gets float64 tables (transformers builds them in
float32 whatever the model's dtype, the main source of the ~1e-7 difference
between the two in float64).
"""

from __future__ import annotations

import math

import torch

from stp.shapes.decoder import RopeScaling

__all__ = ["RopeCache", "apply_rope", "inverse_frequencies"]


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies (wavelength below original / high_freq_factor),
    divide low ones (wavelength above original / low_freq_factor) by `factor`, and
    blend in between with smooth = (original / wavelength - low) / (high - low)."""
    old = scaling.original_max_position_embeddings
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """theta^(-2i / head_dim) for i < head_dim / 2, float64, Llama 3 scaled if asked."""
    half = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / theta**half
    return inv_freq if scaling is None else _llama3_scaled(inv_freq, scaling)


class RopeCache:
    """cos / sin tables [s, head_dim] (each frequency twice: rotate-half layout),
    cached per (seq_len, device, dtype)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self._tables: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device), dtype)
        if key not in self._tables:
            inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
            angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)  # [s, hd]
            self._tables[key] = (angles.cos().to(device, dtype), angles.sin().to(device, dtype))
        return self._tables[key]

    def tensors(self) -> list[torch.Tensor]:
        """Every cached table (shared by all microbatches: never offloaded)."""
        return [t for pair in self._tables.values() for t in pair]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, n, s, hd] rotated by position: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
