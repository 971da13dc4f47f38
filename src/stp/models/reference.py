"""The whole decoder in one process, no TP, plain autograd: the parity reference.

Written independently of the unit code on purpose (F.linear, F.embedding,
F.cross_entropy, repeated kv heads instead of enable_gqa, autograd for every
gradient), so that a stage-by-stage, shard-by-shard run agreeing with it checks
the TP split, the all-reduce placement and the split backward. Parameters have
the same global names and initial values as the stages (stp.models.init).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stp.models.config import ModelConfig
from stp.models.decoder import RopeCache, apply_rope
from stp.models.init import init_full, parameter_specs

__all__ = ["ReferenceModel", "build_reference"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class ReferenceModel(nn.Module):
    """Llama / Qwen2-style decoder: embed, L x (x += attn(norm(x)); x += mlp(norm(x))),
    norm, head, mean cross-entropy."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.specs = parameter_specs(config)
        self._params = {s.name: nn.Parameter(init_full(config, s, dtype)) for s in self.specs}
        for name, p in self._params.items():
            # Same dotted names as the stages, via plain container modules.
            *path, leaf = name.split(".")
            module: nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]  # type: ignore[assignment]
            module.register_parameter(leaf, p)
        self.rope = RopeCache(config.head_dim, config.rope_theta)

    def shard_dim(self, name: str) -> int | None:
        """The dim a TP stage splits parameter `name` on (None: replicated)."""
        for s in self.specs:
            if s.name == name:
                return s.shard_dim
        raise ValueError(f"no parameter {name!r}")

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        c, p = self.config, self._params
        b, s, _ = h.shape
        hd, group = c.head_dim, c.num_heads // c.num_kv_heads
        q = F.linear(h, p[f"layers.{i}.attn.wq.weight"]).view(b, s, c.num_heads, hd).transpose(1, 2)
        k = F.linear(h, p[f"layers.{i}.attn.wk.weight"]).view(b, s, -1, hd).transpose(1, 2)
        v = F.linear(h, p[f"layers.{i}.attn.wv.weight"]).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = self.rope.get(s, h.device, h.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
        x = F.embedding(tokens, p["embed.weight"])
        for i in range(c.num_layers):
            x = x + self._attention(i, _rms_norm(x, p[f"layers.{i}.attn_norm.weight"], c.norm_eps))
            x = x + self._mlp(i, _rms_norm(x, p[f"layers.{i}.mlp_norm.weight"], c.norm_eps))
        return F.linear(_rms_norm(x, p["norm.weight"], c.norm_eps), p["head.weight"])

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all b * s tokens."""
        logits = self.logits(tokens)
        logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(tokens, targets)


def build_reference(config: ModelConfig, dtype: torch.dtype = torch.float32) -> ReferenceModel:
    """The full model with the stages' names and initial values (any pp / tp)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    return ReferenceModel(config, dtype)
