"""The single-device peer: the training loop a user writes without stp.

A Llama-style decoder in a few dozen lines of plain PyTorch, written apart from
stp's model code (it imports nothing of stp: a test reads its imports), and the
loop around it as a user would write it on one device: fp32 parameters, under
bfloat16 autocast on a GPU (float32 on the CPU), `F.scaled_dot_product_attention`
(causal, grouped-query), RMSNorm, rotary embeddings, SwiGLU, an untied head,
gradient accumulation over the microbatches (each microbatch's mean loss over
`m`), global-norm clipping, `torch.optim.AdamW` (fused on CUDA), and one host
read per step: the loss and the gradient norm together, at the end.

`torch.compile(model)` is the compiled variant (the whole model one graph,
the optimizer eager, as a user compiles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainModel", "PlainShape", "Step", "plain_step"]


@dataclass(frozen=True)
class PlainShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    rope_theta: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()  # the statistics in fp32 under autocast, as Llama's reference does
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the half-split form (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, s: PlainShape) -> None:
        super().__init__()
        self.heads, self.kv, self.d = s.heads, s.kv_heads, s.hidden // s.heads
        self.attn_norm, self.mlp_norm = RMSNorm(s.hidden, s.eps), RMSNorm(s.hidden, s.eps)
        self.wq = nn.Linear(s.hidden, s.hidden, bias=False)
        self.wkv = nn.Linear(s.hidden, 2 * s.kv_heads * self.d, bias=False)
        self.wo = nn.Linear(s.hidden, s.hidden, bias=False)
        self.w13 = nn.Linear(s.hidden, 2 * s.ffn, bias=False)  # gate and up, one matmul
        self.w2 = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.d).transpose(1, 2)
        k, v = self.wkv(h).view(b, t, 2, self.kv, self.d).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv != self.heads)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class PlainModel(nn.Module):
    def __init__(self, s: PlainShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        d = s.hidden // s.heads
        inv = 1.0 / s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(torch.arange(s.seq_len, dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


Step = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], tuple[float, float]]


def plain_step(model: PlainModel, *, lr: float, clip: float, compiled: bool,
               betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
               ) -> tuple[Step, torch.optim.Optimizer]:
    """(step, its optimizer): a step takes a list of (tokens, targets) microbatches on
    the model's device and returns (mean loss, gradient norm before clipping), read
    from the device once."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                            weight_decay=0.0, fused=cuda)
    forward = torch.compile(model) if compiled else model

    def step(microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for tokens, targets in microbatches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = forward(tokens, targets) / len(microbatches)
            loss.backward()
            total += loss.detach()
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        loss_value, norm_value = torch.stack([total, norm]).tolist()  # the one host read
        return loss_value, norm_value

    return step, opt
