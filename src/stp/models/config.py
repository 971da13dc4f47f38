"""The decoder's shape: a Llama / Qwen2-style model (RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP, untied embedding and head), the model family STP runs
(seed 000, experiments: Qwen2 12.1B / 26.3B).

The defaults describe a byte-level toy model small enough for CPU tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ModelConfig", "default_ffn_hidden"]


def default_ffn_hidden(hidden: int) -> int:
    """SwiGLU width with the FLOPs of a 4h GELU MLP: 8h/3 rounded up to a multiple of 64
    (three matrices of h x 8h/3 cost as much as two of h x 4h)."""
    return 64 * math.ceil(8 * hidden / 3 / 64)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ModelConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"ModelConfig.{name} must be >= {minimum}, got {value}")


def _check_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"ModelConfig.{name} must be finite, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    """Vocabulary size; 256 is byte-level tokens. Sharded over TP ranks (must divide by tp)."""
    hidden: int = 128
    """Model width h (the residual stream)."""
    num_layers: int = 4
    """Transformer layers, cut contiguously into pipeline stages."""
    num_heads: int = 4
    """Query heads a; hidden must divide by it (head_dim = hidden // num_heads, even for RoPE)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); num_heads must divide by it."""
    ffn_hidden: int | None = None
    """SwiGLU inner width; None means default_ffn_hidden(hidden) (8h/3 rounded up to 64).
    Resolved in __post_init__: dataclasses.replace keeps it unless given ffn_hidden=None."""
    max_seq_len: int = 256
    """Longest sequence a forward accepts."""
    rope_theta: float = 10000.0
    """RoPE base frequency theta (Su et al. 2021)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon added to the mean square."""
    init_std: float = 0.02
    """Std of the normal init of every matrix; the two residual-output projections
    (attn.wo, mlp.w2) use init_std / sqrt(2 * num_layers) (GPT-2 / Megatron scaling)."""
    seed: int = 0
    """Init seed; with a parameter's name it fixes that parameter whatever the mesh."""

    def __post_init__(self) -> None:
        for name, minimum in (
            ("vocab_size", 1), ("hidden", 1), ("num_layers", 1), ("num_heads", 1),
            ("num_kv_heads", 1), ("max_seq_len", 1), ("seed", 0),
        ):
            _check_int(name, getattr(self, name), minimum)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", default_ffn_hidden(self.hidden))
        _check_int("ffn_hidden", self.ffn_hidden, 1)
        for name in ("rope_theta", "norm_eps", "init_std"):
            _check_positive_float(name, getattr(self, name))
        if self.hidden % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden={self.hidden} must be divisible by num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig head_dim = hidden / num_heads = {self.head_dim} must be even (RoPE "
                f"rotates pairs); got hidden={self.hidden}, num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be divisible by "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.seed >= 2**63:
            raise ValueError(f"ModelConfig.seed must be < 2**63, got {self.seed}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head, hidden // num_heads."""
        return self.hidden // self.num_heads

    @property
    def ffn(self) -> int:
        """The resolved SwiGLU width (ffn_hidden after the default is applied)."""
        assert self.ffn_hidden is not None
        return self.ffn_hidden
