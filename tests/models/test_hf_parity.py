"""stp.models.hf.load(dir) computes what transformers computes, float64.

Llama (GQA, explicit head_dim, Llama 3 rope scaling, pad token, untied head) and
Qwen2 (q/k/v bias, tied embeddings, one kv head), weights re-drawn with
non-trivial scales (norm gains in [0.5, 1.5]):
- against stock transformers, logits within 1e-6 (it computes RMSNorm, the
  rotary tables and the eager softmax in float32 even in a float64 model:
  observed ~2e-7);
- against transformers with those replaced by float64 code, logits, the loss
  with ignored targets and every parameter gradient within 1e-12 (observed
  ~4e-15);
- negative controls: gate/up swapped, q/k rows interleaved (the Meta layout),
  kv heads grouped wrongly, a wrong eps: each is caught (off by far more than
  the tolerance).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import _hf
import pytest
import torch

from stp.models import build_reference, hf

F64 = torch.float64
TOL = 1e-12
STOCK_TOL = 1e-6


def _batch(vocab: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (3, 20), generator=g)
    targets = torch.randint(0, vocab, (3, 20), generator=g)
    targets[0, :9] = -100  # a prompt
    targets[2, -4:] = -100  # padding
    return tokens, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_model(path: Path, patched: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    return _hf.float64_everywhere(model) if patched else model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_match_stock_transformers(kind: str, checkpoints: dict[str, Path]) -> None:
    ref = hf.load(checkpoints[kind], dtype=F64)
    theirs = _hf_model(checkpoints[kind], patched=False)
    tokens, _ = _batch(ref.config.vocab_size)
    with torch.no_grad():
        assert _rel(ref.logits(tokens), theirs(input_ids=tokens).logits) < STOCK_TOL


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_loss_and_every_gradient_match_float64_transformers(
    kind: str, checkpoints: dict[str, Path]
) -> None:
    ref = hf.load(checkpoints[kind], dtype=F64)
    theirs = _hf_model(checkpoints[kind], patched=True)
    tokens, targets = _batch(ref.config.vocab_size)
    with torch.no_grad():
        assert _rel(ref.logits(tokens), theirs(input_ids=tokens).logits) < TOL
    mine, their_loss = ref.loss(tokens, targets), _hf.hf_loss(theirs, tokens, targets)
    assert abs(mine.item() - their_loss.item()) < TOL * abs(their_loss.item())
    mine.backward()
    their_loss.backward()
    their_params = dict(theirs.named_parameters())
    names = [n for n, _ in ref.named_parameters()]
    assert len(names) == len(their_params)  # every parameter compared (a tied head once)
    for name, p in ref.named_parameters():
        assert _rel(p.grad, their_params[hf.hf_name(name)].grad) < TOL, name


def _swap_gate_up(t: dict[str, torch.Tensor], c) -> None:
    for i in range(c.num_layers):
        a, b = f"layers.{i}.mlp.w1.weight", f"layers.{i}.mlp.w3.weight"
        t[a], t[b] = t[b], t[a]


def _interleave_qk(t: dict[str, torch.Tensor], c) -> None:
    """Rows of each head in Meta's interleaved rotary layout instead of rotate-half."""
    hd = c.head_dim
    order = torch.arange(hd).view(2, hd // 2).t().reshape(-1)
    for i in range(c.num_layers):
        for w in ("wq", "wk"):
            name = f"layers.{i}.attn.{w}.weight"
            rows = t[name].view(-1, hd, t[name].shape[-1])
            t[name] = rows[:, order].reshape_as(t[name])


def _regroup_kv(t: dict[str, torch.Tensor], c) -> None:
    """Each kv head moved to the next group (query head q meets kv head q // g + 1)."""
    for i in range(c.num_layers):
        for w in ("wk", "wv"):
            name = f"layers.{i}.attn.{w}.weight"
            heads = t[name].view(c.num_kv_heads, c.head_dim, -1)
            t[name] = heads.roll(1, dims=0).reshape_as(t[name])


CONTROLS = {"gate/up swapped": _swap_gate_up, "q/k rows interleaved": _interleave_qk,
            "kv heads regrouped": _regroup_kv}


@pytest.mark.parametrize("control", [*CONTROLS, "eps x 10"])
def test_negative_controls_are_caught(control: str, checkpoints: dict[str, Path]) -> None:
    """Llama (2 kv heads, so a wrong grouping is visible): each mistake moves the
    logits by far more than the parity tolerance."""
    ckpt = hf.HFCheckpoint.open(checkpoints["llama"])
    config, tensors = ckpt.config, ckpt.full_tensors(F64)
    if control in CONTROLS:
        CONTROLS[control](tensors, config)
    else:
        config = dataclasses.replace(config, norm_eps=config.norm_eps * 10)
    wrong = build_reference(config, F64, tensors)
    theirs = _hf_model(checkpoints["llama"], patched=True)
    tokens, _ = _batch(config.vocab_size)
    with torch.no_grad():
        assert _rel(wrong.logits(tokens), theirs(input_ids=tokens).logits) > 1e6 * TOL, control
