"""The whole decoder in one process, no TP, plain autograd: the parity reference.

Written independently of the unit code on purpose (F.linear, F.embedding,
F.cross_entropy, repeated kv heads instead of enable_gqa, autograd for every
gradient, its own rotary embedding), so that a stage-by-stage, shard-by-shard
run agreeing with it checks the TP split, the all-reduce placement, the split
backward and the rotary code of the units. Parameters have the same global
names and initial values as the stages (stp.models.decoder.init, tested against its
specification on its own: tests/models/test_init_spec.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stp.models.decoder.init import ParamSpec, init_full, parameter_specs
from stp.models.param_names import register_dotted
from stp.shapes.decoder import IGNORE_INDEX, ModelConfig, RopeScaling

__all__ = ["ReferenceModel", "build_reference", "rope_frequencies", "rotate"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> list[float]:
    """The rotation speed of each pair of a head, one at a time in Python floats
    (RoFormer, arXiv 2104.09864: theta^(-2i/d)), with Llama 3.1's rescaling as
    Meta's reference code writes it: keep short wavelengths, divide long ones
    by `factor`, interpolate in between."""
    freqs = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if scaling is None:
        return freqs
    old = scaling.original_max_position_embeddings
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    out = []
    for f in freqs:
        wavelength = 2 * math.pi / f
        if wavelength < old / high:
            out.append(f)
        elif wavelength > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def rotate(x: torch.Tensor, freqs: list[float]) -> torch.Tensor:
    """x [b, n, s, d] with the pair (x_j, x_{j+d/2}) at position t turned by the angle
    t * freqs[j] (the rotate-half pairing of transformers' Llama and Qwen2)."""
    s, half = x.shape[-2], x.shape[-1] // 2
    angle = torch.arange(s, dtype=torch.float64)[:, None] * torch.tensor(freqs,
                                                                         dtype=torch.float64)
    c, si = angle.cos().to(x), angle.sin().to(x)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * si, a * si + b * c], dim=-1)


class ReferenceModel(nn.Module):
    """Llama / Qwen2-style decoder: embed, L x (x += attn(norm(x)); x += mlp(norm(x))),
    norm, head, mean cross-entropy over the targets that are not IGNORE_INDEX.
    A tied head is the embedding matrix itself (one parameter, `embed.weight`).
    `tensors`: the full parameters by name (a checkpoint); default the seeded init.
    `specs`: the parameters to make (a family built on the decoder: its own); default
    the decoder's."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        tensors: dict[str, torch.Tensor] | None = None,
        specs: list[ParamSpec] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        if specs is None:
            specs = parameter_specs(config)
        self.specs = [s for s in specs if s.tied_to is None]
        if tensors is None:
            tensors = {s.name: init_full(config, s, dtype) for s in self.specs}
        self._params = {s.name: nn.Parameter(tensors[s.name].to(dtype)) for s in self.specs}
        for name, p in self._params.items():
            register_dotted(self, name, p)
        self.freqs = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)

    def shard_dim(self, name: str) -> int | None:
        """The dim a TP stage splits parameter `name` on (None: replicated)."""
        for s in self.specs:
            if s.name == name:
                return s.shard_dim
        raise ValueError(f"no parameter {name!r}")

    def _proj(self, i: int, which: str, h: torch.Tensor) -> torch.Tensor:
        p, name = self._params, f"layers.{i}.attn.{which}"
        return F.linear(h, p[f"{name}.weight"], p.get(f"{name}.bias"))

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        c, p = self.config, self._params
        b, s, _ = h.shape
        hd, group = c.head_dim, c.num_heads // c.num_kv_heads
        q = self._proj(i, "wq", h).view(b, s, c.num_heads, hd).transpose(1, 2)
        k = self._proj(i, "wk", h).view(b, s, -1, hd).transpose(1, 2)
        v = self._proj(i, "wv", h).view(b, s, -1, hd).transpose(1, 2)
        q, k = rotate(q, self.freqs), rotate(k, self.freqs)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / hd**0.5  # [b, a, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = scores.softmax(-1) @ v  # [b, a, s, hd]
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), p[f"layers.{i}.attn.wo.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = self._params
        gate = F.silu(F.linear(h, p[f"layers.{i}.mlp.w1.weight"]))
        up = F.linear(h, p[f"layers.{i}.mlp.w3.weight"])
        return F.linear(gate * up, p[f"layers.{i}.mlp.w2.weight"])

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, V]."""
        c, p = self.config, self._params
        if tokens.shape[1] > c.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={c.max_seq_len}"
            )
        x = F.embedding(tokens, p["embed.weight"], padding_idx=c.pad_token_id)
        for i in range(c.num_layers):
            x = x + self._attention(i, _rms_norm(x, p[f"layers.{i}.attn_norm.weight"], c.norm_eps))
            x = x + self._mlp(i, _rms_norm(x, p[f"layers.{i}.mlp_norm.weight"], c.norm_eps))
        head = p["embed.weight"] if c.tie_embeddings else p["head.weight"]
        return F.linear(_rms_norm(x, p["norm.weight"], c.norm_eps), head)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not IGNORE_INDEX (-100)."""
        logits = self.logits(tokens)
        logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE_INDEX)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(tokens, targets)


def build_reference(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    tensors: dict[str, torch.Tensor] | None = None,
) -> ReferenceModel:
    """The full model with the stages' names and initial values (any pp / tp), or
    with the full `tensors` given by name."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    return ReferenceModel(config, dtype, tensors)
