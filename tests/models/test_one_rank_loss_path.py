"""At one TP rank the embedding and the cross-entropy skip the vocab-parallel ownership
masks (issue 35: fewer aten ops a step). They must give the bits the masked path
gives, with ignored targets too; and the cheaper logsumexp and CPU clip scale must
be bit-equal to torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stp.models.decoder.end_units import EmbedUnit
from stp.models.tp.layers import (
    _logsumexp,
    vocab_ce_finish,
    vocab_ce_grad,
    vocab_ce_stats,
)
from stp.shapes.decoder import IGNORE_INDEX
from stp.train.step.clip import scale_grads

D = torch.float64
V = 32


def _logits_targets() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, V, generator=g, dtype=D) * 3
    targets = torch.randint(0, V, (3, 7), generator=g)
    targets[0, 2] = targets[2, 6] = IGNORE_INDEX
    return logits, targets


def test_one_rank_cross_entropy_is_torchs_and_the_masked_paths_bits():
    logits, targets = _logits_targets()
    stats = vocab_ce_stats(logits, targets, 0, 1, 0, V)
    loss, lse = vocab_ce_finish(stats, targets)
    want = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum",
                           ignore_index=IGNORE_INDEX) / targets.numel()
    torch.testing.assert_close(loss, want, rtol=1e-14, atol=0)
    assert torch.equal(lse, torch.logsumexp(logits, -1))
    grad_loss = torch.tensor(0.75, dtype=D)
    fast = vocab_ce_grad(logits, targets, lse, None, grad_loss, V)
    masked = vocab_ce_grad(logits, targets, lse, 0, grad_loss, V)
    assert torch.equal(fast, masked)
    # and both are autograd's gradient of the loss
    x = logits.clone().requires_grad_(True)
    (F.cross_entropy(x.reshape(-1, V), targets.reshape(-1), reduction="sum",
                     ignore_index=IGNORE_INDEX) / targets.numel() * grad_loss).backward()
    torch.testing.assert_close(fast, x.grad, rtol=1e-12, atol=1e-15)
    assert not fast[0, 2].any() and not fast[2, 6].any()  # ignored: no gradient


def test_logsumexp_has_torchs_bits():
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, D, torch.bfloat16):
        x = (torch.randn(4, 9, 50, generator=g) * 10).to(dtype)
        x[1, 3, :7] = float("-inf")  # masked vocabulary padding
        for dim in (-1, 0):
            assert torch.equal(_logsumexp(x, dim), torch.logsumexp(x, dim)), (dtype, dim)


@pytest.mark.parametrize("pad", [None, 5])
def test_one_rank_embedding_equals_the_masked_lookup(pad):
    """Forward rows and, after B and W, the weight's gradient: the same bits as the
    masked path; the fast path keeps the ids alone from F to B."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, V, (2, 9), generator=g)
    ids[0, 0] = 5
    grad = torch.randn(2, 9, 16, generator=g, dtype=D)
    out = {}
    for whole in (False, True):
        weight = torch.randn(V, 16, generator=torch.Generator().manual_seed(7), dtype=D)
        unit = EmbedUnit(weight, 0, pad, whole_vocab=whole)
        rows = unit.forward_finish(0, unit.forward_partial(0, ids))
        kept = sum(t.nbytes for t in unit.kept_tensors(0))
        unit.backward_finish(0, unit.backward_partial(0, grad))
        unit.weight(0)
        out[whole] = rows, weight.grad, kept
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])
    weight = torch.randn(V, 16, generator=torch.Generator().manual_seed(7), dtype=D)
    assert torch.equal(out[True][0], F.embedding(ids, weight))
    assert out[True][2] <= out[False][2]
    if pad is not None:
        assert not out[True][1][pad].any()  # the pad row is looked up, never trained


@pytest.mark.parametrize("dtype", [torch.float32, D, torch.bfloat16, torch.float16])
def test_cpu_clip_scale_has_the_python_floats_bits(dtype):
    g = torch.Generator().manual_seed(8)
    for factor in (1 / 3, 0.123456789123, 0.9999999, 1.0):
        a = [torch.randn(50, generator=g).to(dtype) for _ in range(3)]
        b = [t.clone() for t in a]
        torch._foreach_mul_(a, factor)
        scale_grads(b, factor)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), factor
