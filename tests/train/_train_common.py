"""Shared by tests/train: a tiny float64 model, its batches, the training settings
with clipping and an LR schedule active, and the single-process torch reference
they must agree with, built from torch's own pieces only (clip_grad_norm_,
torch.optim.AdamW, LinearLR then CosineAnnealingLR), not stp's `adamw` and
`make_scheduler`: a bug there would otherwise be on both sides."""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from stp.models import ModelConfig, build_reference
from stp.train.step.lr import LRSchedule, adamw

CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
SEQ, ROWS, M = 8, 16, 8
"""Sequence length, global batch rows, microbatches (every mesh: dp x m x size = 16)."""
CLIP = 0.05
"""Below every step's gradient norm (about 1 to 2 here): clipping is active."""
LR, WEIGHT_DECAY = 1e-2, 0.1
BETAS, EPS = (0.9, 0.95), 1e-8
"""stp.train.step.lr.adamw's documented defaults, which `optimizer` relies on."""
SCHEDULE = LRSchedule("cosine", total_steps=6, warmup=2, min_lr=1e-3)
TOL = 1e-9


def optimizer():
    return adamw(LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS)


def options(**kw) -> dict:
    """Trainer keywords: float64, clipping and the schedule (override with kw)."""
    return {"dtype": torch.float64, "clip_grad": CLIP, "lr_schedule": SCHEDULE, "timeout": 60,
            **kw}


def batch(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    tok = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def train(trainer, steps: range) -> list[tuple[float, float, float]]:
    """(loss, grad_norm, lr) of each step."""
    out = []
    for step in steps:
        loss = trainer.step(batch(step))
        u = trainer.last_update
        out.append((loss, u.grad_norm, u.lr))
    return out


def reference(steps: int) -> tuple[list[tuple[float, float, float]], dict[str, torch.Tensor]]:
    """The same training in one process with torch's own pieces, set up as
    stp.train.step.lr documents: weight decay on matrices only, warm-up from
    LR / warmup to LR over `warmup` updates, then cosine to min_lr at
    total_steps."""
    # torch's cosine is periodic past T_max, where stp's schedule holds min_lr.
    assert steps <= SCHEDULE.total_steps and SCHEDULE.kind == "cosine"
    model = build_reference(CONFIG, torch.float64)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS)
    warmup = LinearLR(opt, start_factor=1 / SCHEDULE.warmup, end_factor=1.0,
                      total_iters=SCHEDULE.warmup - 1)
    cosine = CosineAnnealingLR(opt, T_max=SCHEDULE.total_steps - SCHEDULE.warmup,
                               eta_min=SCHEDULE.min_lr)
    sched = SequentialLR(opt, [warmup, cosine], milestones=[SCHEDULE.warmup])
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss = model.loss(*batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        out.append((loss.item(), float(norm), opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


def worst(a: list[tuple[float, ...]], b: list[tuple[float, ...]]) -> float:
    """Largest relative difference between two lists of per-step tuples."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-300)
               for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def worst_param(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)
