"""The decoder's shape: a Llama / Qwen2-style model (RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP, untied embedding and head), the model family STP runs
(STP paper arXiv 2510.27257, experiments: Qwen2 12.1B / 26.3B).

The defaults describe a byte-level toy model small enough for CPU tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["IGNORE_INDEX", "ModelConfig", "RopeScaling", "default_ffn_hidden"]

IGNORE_INDEX = -100
"""A target with this value is left out of the loss (prompt tokens, padding), as in
torch.nn.functional.cross_entropy and Hugging Face labels."""


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
class RopeScaling:
    """Llama 3 rotary frequency scaling (config.json `rope_type: llama3`): wavelengths
    longer than original_max_position_embeddings / low_freq_factor are stretched by
    `factor`, shorter than original / high_freq_factor are kept, and the band between
    is interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_positive_float(f"rope_scaling.{name}", getattr(self, name))
        _check_int("rope_scaling.original_max_position_embeddings",
                   self.original_max_position_embeddings, 1)
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"ModelConfig.rope_scaling.high_freq_factor={self.high_freq_factor} must be "
                f"greater than low_freq_factor={self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    """Vocabulary size; 256 is byte-level tokens. Sharded over TP ranks, padded to a
    multiple of tp (padded_vocab)."""
    hidden: int = 128
    """Model width h (the residual stream)."""
    num_layers: int = 4
    """Transformer layers, cut contiguously into pipeline stages."""
    num_heads: int = 4
    """Query heads a; without explicit_head_dim, hidden must divide by it (head_dim =
    hidden // num_heads, even for RoPE)."""
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
    explicit_head_dim: int | None = None
    """Width of one attention head when it is not hidden // num_heads (config.json
    `head_dim`); None: hidden // num_heads."""
    qkv_bias: bool = False
    """Bias on the q, k, v projections (Qwen2); split over TP with their columns."""
    tie_embeddings: bool = False
    """The head reuses the embedding matrix (config.json `tie_word_embeddings`). Stages
    hold two copies that stay equal: their gradients are summed every step."""
    rope_scaling: RopeScaling | None = None
    """Llama 3 rotary frequency scaling; None: plain RoPE."""
    pad_token_id: int | None = None
    """Its embedding row gets no gradient from the lookup (torch.nn.Embedding's
    padding_idx, as transformers builds the embedding)."""

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
        self._check_heads()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be divisible by "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.seed >= 2**63:
            raise ValueError(f"ModelConfig.seed must be < 2**63, got {self.seed}")
        self._check_extras()

    def _check_heads(self) -> None:
        if self.explicit_head_dim is not None:
            _check_int("explicit_head_dim", self.explicit_head_dim, 2)
            if self.head_dim % 2:
                raise ValueError(f"ModelConfig.explicit_head_dim={self.head_dim} must be even "
                                 "(RoPE rotates pairs)")
            return
        if self.hidden % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden={self.hidden} must be divisible by num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig head_dim = hidden / num_heads = {self.head_dim} must be even (RoPE "
                f"rotates pairs); got hidden={self.hidden}, num_heads={self.num_heads}"
            )

    def _check_extras(self) -> None:
        for name in ("qkv_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got "
                             f"{self.rope_scaling!r}")
        if self.pad_token_id is not None:
            _check_int("pad_token_id", self.pad_token_id, 0)
            if self.pad_token_id >= self.vocab_size:
                raise ValueError(f"ModelConfig.pad_token_id={self.pad_token_id} must be < "
                                 f"vocab_size={self.vocab_size}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: explicit_head_dim, else hidden // num_heads."""
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.hidden // self.num_heads

    def padded_vocab(self, tp_size: int) -> int:
        """vocab_size rounded up to a multiple of tp_size: each TP rank holds an equal
        slice of the embedding and head; the padding rows are zeros that no token
        uses and whose logits the loss masks out."""
        return -(-self.vocab_size // tp_size) * tp_size

    def kv_replicas(self, tp_size: int) -> int:
        """TP ranks holding a copy of each kv head: tp_size / num_kv_heads when there
        are fewer kv heads than ranks (each rank keeps the one kv head its query
        heads use), else 1."""
        return max(1, tp_size // self.num_kv_heads)

    @property
    def ffn(self) -> int:
        """The resolved SwiGLU width (ffn_hidden after the default is applied)."""
        assert self.ffn_hidden is not None
        return self.ffn_hidden
