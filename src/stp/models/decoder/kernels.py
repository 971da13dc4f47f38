"""The pieces of a decoder unit between its linears, behind one object a stage can
swap: RMSNorm, rotary embedding, the SwiGLU gate and the vocab-parallel
cross-entropy's statistics and gradient; and two runs of a unit's body with
their linears (`qkv_rope`: the q, k, v projections and their rotation;
`attn_out`: the output projection; `mlp`: the whole SwiGLU MLP), which a
compiled set runs as one piece each way with the linears' weight work still
going to the unit's sink.

Everything the split backward hangs on stays outside them: the linears (whose
inputs and output gradients W records, stp.models.tp.wgrad), the attention core
(which selective recomputation replaces, stp.models.recompute) and the unit
boundaries (where braiding puts the TP all-reduces). So a stage can run these
pieces eagerly (`EAGER`, the default: the functions of stp.models.tp.layers and
stp.models.decoder.rope as they are) or compiled (stp.models.compile) without
changing what B, W, recomputation or offload see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stp.models.decoder.rope import apply_rope
from stp.models.recompute import attention_core
from stp.models.tp.layers import linear, rms_norm, vocab_ce_grad, vocab_ce_stats
from stp.models.tp.wgrad import GradTaps, WGradEntry

__all__ = ["Kernels", "EAGER"]


class Kernels:
    """Eager kernels: each method is the plain PyTorch code the units always ran."""

    compiled = False
    loss_graphs = None
    """The loss unit as one graph per direction (stp.models.compile_loss.LossGraphs):
    a compiled set only; eagerly the unit runs the pieces below."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
             sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        """RMSNorm with the gain's gradient deferred to `sink` (stp.models.tp.layers.rms_norm)."""
        return rms_norm(x, weight, eps, sink)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [b, heads, s, hd] rotated by position."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, the input of the MLP's down projection."""
        return F.silu(gate) * up

    def qkv_rope(self, h: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                 cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                 sink: list[WGradEntry] | GradTaps | None) -> tuple[torch.Tensor, ...]:
        """h [b, s, hidden] -> q, k, v [b, heads, s, head_dim], q and k rotated; the
        projections' weight work deferred to `sink` (stp.models.tp.layers.linear)."""
        b, s, _ = h.shape
        q, k, v = (linear(h, w, sink, bias).view(b, s, -1, head_dim).transpose(1, 2)
                   for w, bias in zip(weights, biases, strict=True))
        q, k = self.rope(q, k, cos, sin)
        return q, k, v

    def attn_out(self, o: torch.Tensor, wo: torch.Tensor,
                 sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        """The attention core's output o [b, heads, s, hd] through the output projection:
        [b, s, hidden], a partial sum over TP."""
        b, _, s, _ = o.shape
        return linear(o.transpose(1, 2).reshape(b, s, -1), wo, sink)

    def attention(self, h: torch.Tensor,
                  weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], wo: torch.Tensor,
                  biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                  cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                  sink: list[WGradEntry] | GradTaps | None, recompute: str,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        """An attention unit's body: `qkv_rope`, the attention core, `attn_out`; `mask`:
        document masking's, in place of the causal rule (stp.models.documents)."""
        q, k, v = self.qkv_rope(h, weights, biases, cos, sin, head_dim, sink)
        o = attention_core(q, k, v, causal=True, gqa=True, recompute=recompute, mask=mask)
        return self.attn_out(o, wo, sink)

    def mlp(self, h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        """w2(silu(w1 h) * w3 h): the SwiGLU MLP, [b, s, hidden] -> [b, s, hidden]."""
        return linear(self.swiglu(linear(h, w1, sink), linear(h, w3, sink)), w2, sink)

    def norm_qkv_rope(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                      cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                      sink: GradTaps | None) -> tuple[torch.Tensor, ...]:
        """RMSNorm then `qkv_rope`: an attention unit's branch at one TP rank, where no
        all-reduce sits between them (stp.models.decoder.chunk)."""
        h = self.norm(x, norm_w, eps, sink)
        return self.qkv_rope(h, weights, biases, cos, sin, head_dim, sink)

    def norm_mlp(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float, w1: torch.Tensor,
                 w3: torch.Tensor, w2: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        """RMSNorm then `mlp`: an MLP unit's branch at one TP rank."""
        return self.mlp(self.norm(x, norm_w, eps, sink), w1, w3, w2, sink)

    def layers(self, parts: tuple, x: torch.Tensor,
               sink: GradTaps | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer chunk's units at one TP rank (stp.models.decoder.chunk): (the stream
        before the last residual add, the last unit's branch)."""
        h = x
        for part in parts[:-1]:
            h = h + part.branch(h, sink)
        return h, parts[-1].branch(h, sink)

    def ce_stats(self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                 tp_size: int, tp_rank: int, vocab_valid: int | None) -> torch.Tensor:
        """stp.models.tp.layers.vocab_ce_stats (logits detached)."""
        return vocab_ce_stats(logits, targets, vocab_start, tp_size, tp_rank, vocab_valid)

    def ce_grad(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                vocab_start: int | None, grad_loss: torch.Tensor,
                vocab_valid: int | None) -> torch.Tensor:
        """stp.models.tp.layers.vocab_ce_grad (logits detached; vocab_start None: the
        whole vocabulary, one TP rank)."""
        return vocab_ce_grad(logits, targets, lse, vocab_start, grad_loss, vocab_valid)


EAGER = Kernels()
