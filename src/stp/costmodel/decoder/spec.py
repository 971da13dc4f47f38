"""A decoder-only transformer's shape, and its FLOPs and activation bytes per layer.

Formulas (per transformer layer, one microbatch: `s` sequence, `b`
microbatch size, `h` hidden, `a` query heads, `k` key/value heads,
`d = h / a` head size, `f` feed-forward width, `t` tensor-parallel size):

FLOPs count matmuls only, 2 FLOPs per multiply-add (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters", SC'21,
arXiv 2104.04473, section 5.1; "Zero Bubble Pipeline Parallelism",
arXiv 2401.10241, Table 1):

    linear  L = 2sb (h (h + 2kd) + h h + g h f)     QKV, output projection, MLP
                                                     (g = 3 gated SwiGLU, 2 GELU)
    attn    A = 4 s^2 b h                            QK^T and (softmax) V
            (document masking, `mean_doc_len` L: 4 s L b h, each token
            attending within its document; causal attention counted full)
    F = L + A        B = L + 2A        W = L

Each forward matmul has two backward matmuls of the same size, one for the
input gradient (B) and one for the weight gradient (W); attention has no
weights, so both of its backward matmuls are in B. For a GPT layer
(k = a, g = 2, f = 4h) this is Zero Bubble's Table 1 exactly:
F = sbh(24h + 4s), B = sbh(24h + 8s), W = 24sbh^2.

Activation bytes (16-bit activations, 1-byte dropout masks), term by term as
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (MLSys 2023), section 4.1, generalised to GQA and gated MLPs:

    M_B = sb [ 10h + (2h + 4kd + 2h + 2(g-1)f + 2f) / t ] + 5 a s^2 b / t
          (replicated: 2 LayerNorm inputs 4h, their outputs 4h, 2 dropout masks
           2h; split by TP: Q, K, V, attention output, MLP hidden values;
           attention scores, softmax and its dropout 5as^2b unless flash)
    M_W = 2sb [ (2h + (h + 2kd)/t) + (h/t + h) + (h + (g-1)f/t) + (f/t + h) ]
          (what W needs: each linear layer's input and its output gradient)

A mixture of experts (`stp.costmodel.moe`) reads `f` as the width a token
computes (its top-k experts and the shared expert) and adds its routed
copies and router state (`ModelSpec.mlp_width`, `routed_copies`,
`routing_bytes`, overridden there).

For GPT (t = 1) these are Zero Bubble's `M_B = sb(34h + 5as)` and
`M_W = 32sbh` (Table 1). With sequence parallelism the replicated terms are
split too (Korthikanti eq. 5); flash attention keeps no s^2 terms.

Activation recomputation (`recompute`; Korthikanti et al., section 5):

    selective  the attention core (Q K^T, softmax, its dropout, the weighted
               sum) is recomputed in B: M_B loses its `5 a s^2 b / t` term
               (eq. 6: `34 s b h / t` per layer with SP) and B gains the
               core's forward FLOPs `A = 4 s^2 b h / t`. With flash
               attention the kernel already keeps no scores and recomputes
               them in its own backward, so selective changes nothing.
    full       only the layer's input is kept (`2 s b h`, `/ t` with SP,
               section 5 "full activation recomputation"); B recomputes the
               whole forward (B gains F). M_W is capped at that M_B: a split
               backward whose W runs later must keep the inputs B recomputed
               for it, a growth at B that the simulator's memory model (F
               allocates, B and W free) cannot express, so full
               recomputation is exact for full backwards (W right after B)
               and understates a deferred W by up to the old M_W minus
               `2 s b h / t` per microbatch waiting for its W.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from stp.costmodel.hardware import HardwareSpec

__all__ = ["RECOMPUTE_MODES", "ModelSpec", "decoder_only", "layer_flops", "layer_activation_bytes",
           "num_parameters"]

RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation: nothing, the attention core, or the whole layer."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer and how one microbatch is cut."""

    layers: int
    """Transformer layers of the whole model."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Query heads a."""
    kv_heads: int
    """Key/value heads k (k = a: multi-head attention; k < a: GQA)."""
    ffn: int
    """Feed-forward width f (GPT: 4h)."""
    vocab: int
    """Vocabulary size (embedding and output layer; on the first and last stage)."""
    sequence: int
    """Sequence length s."""
    micro_batch: int = 1
    """Sequences per microbatch b."""
    tp: int = 1
    """Tensor-parallel size t (Megatron column/row split of every layer)."""
    gated_mlp: bool = True
    """SwiGLU-style MLP (3 matrices) instead of GELU (2 matrices)."""
    flash_attention: bool = False
    """Attention kernels that keep no s x s scores (no 5as^2b activation term)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the replicated activations are split by t too,
    and each all-reduce becomes a reduce-scatter and an all-gather."""
    name: str = "custom"
    recompute: str = "none"
    """Activation recomputation: none, selective (the attention core) or full."""
    dropout: bool = True
    """The layer keeps dropout masks (Korthikanti's formulas count them: 2 s b h
    bytes after attention and the MLP, `a s^2 b` after the softmax). stp's own
    decoder, Llama and Qwen2 train without dropout: specs made from their
    configs (`stp.costmodel.configs`) set False, and those bytes go."""

    mean_doc_len: int | None = None
    """Document masking (`stp train --document-mask`): the mean tokens per document
    of the packed rows. A row of s tokens in documents of L tokens computes (s / L)
    L x L score blocks, s L entries instead of s^2, so attention's FLOPs fall by L / s
    (the bytes do not: stp's masked attention keeps the same tensors). None: no
    masking, every token attends over the whole sequence."""

    _ZERO_OK: ClassVar[tuple[str, ...]] = ()
    """Integer fields that may be 0 (a subclass's optional parts)."""

    def __post_init__(self) -> None:
        for fl in fields(self):
            val = getattr(self, fl.name)
            low = 0 if fl.name in self._ZERO_OK else 1
            if fl.type == "int" and (not isinstance(val, int) or isinstance(val, bool)
                                     or val < low):
                raise ValueError(f"model {fl.name}={val!r} must be an integer >= {low}")
        if self.mean_doc_len is not None and (
                not isinstance(self.mean_doc_len, int) or isinstance(self.mean_doc_len, bool)
                or self.mean_doc_len < 1):
            raise ValueError(f"--mean-doc-len {self.mean_doc_len!r} must be an integer >= 1 "
                             "(tokens per document)")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"model recompute={self.recompute!r}: choose one of "
                             f"{', '.join(RECOMPUTE_MODES)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"model hidden={self.hidden} must be a multiple of heads={self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model heads={self.heads} must be a multiple of kv_heads={self.kv_heads}"
            )
        if self.heads % self.tp or self.kv_heads % self.tp and self.tp % self.kv_heads:
            raise ValueError(
                f"model tp={self.tp} must divide heads={self.heads} (and divide or be a "
                f"multiple of kv_heads={self.kv_heads})"
            )

    @property
    def attention_span(self) -> int:
        """Keys a query's score row spans on average: the sequence, or with document
        masking the mean document (at most the sequence)."""
        if self.mean_doc_len is None:
            return self.sequence
        return min(self.mean_doc_len, self.sequence)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    # What a layer's MLP is, as the formulas below read it. A dense MLP: one
    # input of h values per token, a hidden layer of f. A mixture of experts
    # (stp.costmodel.moe.spec.MoESpec) overrides these with its routed copies.

    @property
    def mlp_width(self) -> float:
        """Hidden width a token's MLP computes (a layer's mean)."""
        return float(self.ffn)

    @property
    def routed_copies(self) -> float:
        """Extra h-wide copies of each token the MLP makes (a layer's mean): a
        mixture of experts' dispatched inputs, one per chosen expert, each with
        its expert's h-wide output kept for the routing weight's gradient."""
        return 0.0

    @property
    def routing_bytes(self) -> float:
        """Bytes per token a layer's router keeps from F to B (a layer's mean)."""
        return 0.0

    def mlp_parameters(self) -> tuple[float, float]:
        """(dense, expert) MLP weights of a layer (a layer's mean, whole model): the
        expert ones are split over expert-parallel ranks, the dense ones are not."""
        return float(self.mlp_matrices * self.hidden * self.ffn), 0.0

    # Expert parallelism, as the shared memory, time and planner code asks it: a
    # decoder has no experts; a mixture of experts (stp.costmodel.moe.spec) answers
    # otherwise. The questions live on the spec so that no caller tests its class.

    @property
    def ep(self) -> int:
        """Expert-parallel ranks the spec is cut for (1: no experts to split)."""
        return 1

    @property
    def has_experts(self) -> bool:
        """Whether the MLP routes tokens to experts (and ep is a mesh axis)."""
        return False

    def ep_sizes(self) -> tuple[int, ...]:
        """The expert-parallel sizes the model's experts split into."""
        return (1,)

    def with_ep(self, ep: int) -> ModelSpec:
        """The spec cut for `ep` expert-parallel ranks; ValueError (one line) for a
        size the model cannot take."""
        if ep != 1:
            raise ValueError(f"ep={ep}: expert parallelism needs a mixture-of-experts "
                             f"model; {self.name} has no experts")
        return self

    def at_layout_ep(self, ep: int | None, dp: int) -> tuple[ModelSpec, str | None]:
        """The spec at a layout's `ep` (None: the spec's own, where it divides `dp`),
        and a note when the spec's own ep was set aside (stp.costmodel.memory_types
        `Layout.ep`)."""
        return self.with_ep(1 if ep is None else ep), None

    def router_parameters(self) -> float:
        """A layer's weights every TP rank holds whole (a router, its gate): none."""
        return 0.0

    @property
    def a2a_copies(self) -> float:
        """h-wide values per token one all-to-all moves at ep > 1 (none without experts)."""
        return 0.0

    def layer_a2a_time(self, hardware: HardwareSpec) -> float:
        """Seconds of a layer's all-to-alls in one F (or B) pass: none."""
        return 0.0

    def kept_extra(self, dtype_bytes: int, tp: int, native_weights: bool) -> float:
        """Bytes per token a layer's units keep beyond the census formulas
        (stp.costmodel.decoder.kept): none for the decoder they were fitted to."""
        return 0.0


def layer_flops(spec: ModelSpec) -> tuple[float, float, float]:
    """(F, B, W) FLOPs of one transformer layer for one microbatch, one TP rank."""
    # f: the width a token's MLP computes (a mixture of experts: its top-k and shared)
    s, b, h, f = spec.sequence, spec.micro_batch, spec.hidden, spec.mlp_width
    kd = spec.kv_heads * spec.head_dim
    linear = 2 * s * b * (h * (h + 2 * kd) + h * h + spec.mlp_matrices * h * f)
    attn = 4 * s * spec.attention_span * b * h
    t = spec.tp
    recomputed = 0.0  # the forward B runs again (module doc, recomputation)
    if spec.recompute == "full":
        recomputed = linear + attn
    elif spec.recompute == "selective" and not spec.flash_attention:
        recomputed = attn
    return (linear + attn) / t, (linear + 2 * attn + recomputed) / t, linear / t


def layer_activation_bytes(spec: ModelSpec) -> tuple[float, float]:
    """(M_B, M_W) bytes of one transformer layer for one microbatch, one TP rank."""
    s, b, h, f, t = spec.sequence, spec.micro_batch, spec.hidden, spec.mlp_width, spec.tp
    kd = spec.kv_heads * spec.head_dim
    g = spec.mlp_matrices
    replicated = 10 * h if spec.dropout else 8 * h  # less the two 1-byte dropout masks
    # routed copies: each extra h-wide input the experts read, and each h-wide expert
    # output kept for the routing weights' gradient, 2 bytes a value; the router's own
    x = spec.routed_copies
    replicated += 4 * h * x + spec.routing_bytes
    split = 2 * h + 4 * kd + 2 * h + 2 * (g - 1) * f + 2 * f
    if spec.sequence_parallel:
        m_b = s * b * (replicated + split) / t
    else:
        m_b = s * b * (replicated + split / t)
    if not spec.flash_attention and spec.recompute == "none":
        per_score = 5 if spec.dropout else 4  # scores, softmax (2 bytes each), dropout mask
        m_b += per_score * spec.heads * s * s * b / t
    sp = t if spec.sequence_parallel else 1
    m_w = 2 * s * b * (
        (h / sp + (h + 2 * kd) / t)  # QKV: input, output gradient
        + (h / t + h / sp)  # attention output projection
        + (h / sp + h * x / sp + (g - 1) * f / t)  # MLP up (and gate); routed copies
        + (f / t + h / sp + h * x / sp)  # MLP down
    )
    if spec.recompute == "full":
        m_b = 2 * s * b * h / sp  # the layer input only
        m_w = min(m_w, m_b)
    return m_b, m_w


def num_parameters(spec: ModelSpec, *, tied_embeddings: bool = False) -> int:
    """Weights of the whole model (biases and norms left out: under 0.1%)."""
    h = spec.hidden
    kd = spec.kv_heads * spec.head_dim
    per_layer = h * (h + 2 * kd) + h * h + sum(spec.mlp_parameters())
    embed = spec.vocab * h * (1 if tied_embeddings else 2)
    return spec.layers * per_layer + embed


def decoder_only(spec: object, feature: str) -> ModelSpec:
    """`spec` when it is a decoder's; else a one-line ValueError saying that
    `feature` has formulas for decoders only (the multimodal encoder has none
    yet). Callers above the cost model ask here instead of testing classes."""
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"{feature} covers decoder models; a {type(spec).__name__} has no "
                         "formulas for it yet")
    return spec
