"""TP pieces in one process: the split-backward Functions against plain autograd, and
the vocab-parallel embedding / cross-entropy with the TP ranks simulated by a loop
(the all-reduce is a sum, so summing the ranks' partials is exactly what it does)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stp.models.tp import (
    WGradStore,
    identity_allreduce,
    linear,
    make_allreduce,
    rms_norm,
    start_allreduce,
    vocab_ce_finish,
    vocab_ce_grad,
    vocab_ce_stats,
    vocab_embedding_partial,
)
from stp.models.tp.wgrad import LinearGrad, NormGrad

D = torch.float64


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-12) -> bool:
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-30)


def test_linear_b_gives_input_grad_only_and_w_the_weight_grad():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 6, dtype=D, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, 6, dtype=D, generator=g))
    dy = torch.randn(2, 5, 4, dtype=D, generator=g)
    sink: list = []
    (dx,) = torch.autograd.grad(linear(x, w, sink), x, dy)
    assert w.grad is None, "B must not touch .grad"
    assert len(sink) == 1 and isinstance(sink[0], LinearGrad)

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    F.linear(x_ref, w_ref).backward(dy)
    assert close(dx, x_ref.grad)
    sink[0].accumulate()
    assert close(w.grad, w_ref.grad)
    sink[0].accumulate()  # a second microbatch accumulates
    assert close(w.grad, 2 * w_ref.grad)


def test_rms_norm_split_backward_matches_autograd():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 8, dtype=D, generator=g, requires_grad=True)
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(8, dtype=D, generator=g))
    dy = torch.randn(3, 4, 8, dtype=D, generator=g)
    sink: list = []
    y = rms_norm(x, w, 1e-6, sink)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert w.grad is None and isinstance(sink[0], NormGrad)
    sink[0].accumulate()

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    y_ref = F.rms_norm(x_ref, (8,), w_ref, 1e-6)
    y_ref.backward(dy)
    assert close(y, y_ref) and close(dx, x_ref.grad) and close(w.grad, w_ref.grad)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_sums_to_the_full_lookup(tp: int):
    g = torch.Generator().manual_seed(3)
    vocab, h = 16, 5
    table = torch.randn(vocab, h, dtype=D, generator=g)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    total = torch.zeros(2, 7, h, dtype=D)
    owners = torch.zeros(2, 7, dtype=torch.long)
    for t in range(tp):
        shard = table.chunk(tp)[t]
        partial, owned, local = vocab_embedding_partial(ids, shard, t * vocab // tp)
        total += partial
        owners += owned.long()
        assert torch.equal(shard[local[owned]], table[ids[owned]])
    assert torch.equal(owners, torch.ones_like(owners)), "each id has exactly one owner"
    assert torch.equal(total, F.embedding(ids, table))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_vocab_parallel_cross_entropy_matches_the_full_softmax(tp: int, offset: float):
    # offset 1e4: exp would overflow without the max shift; the loss must stay exact.
    g = torch.Generator().manual_seed(4)
    vocab = 24
    logits = torch.randn(2, 6, vocab, dtype=D, generator=g) * 3 + offset
    targets = torch.randint(0, vocab, (2, 6), generator=g)
    shards = logits.chunk(tp, dim=-1)
    stats = sum(
        vocab_ce_stats(shards[t], targets, t * vocab // tp, tp, t) for t in range(tp)
    )
    loss, lse = vocab_ce_finish(stats)

    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref.backward(torch.tensor(0.5, dtype=D))
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) <= 1e-12 * max(1.0, ref.item())
    half = torch.tensor(0.5)
    grads = [vocab_ce_grad(shards[t], targets, lse, t * vocab // tp, half) for t in range(tp)]
    assert close(torch.cat(grads, dim=-1), ref_logits.grad, rel=1e-10)


def test_allreduce_of_one_rank_is_identity():
    t = torch.arange(3.0)
    assert make_allreduce(None, 1) is identity_allreduce
    assert start_allreduce(t, None, 1).wait() is t


def test_wgrad_store_rejects_a_second_open_and_frees_after_flush():
    store = WGradStore()
    sink = store.open(0)
    with pytest.raises(RuntimeError, match="microbatch 0"):
        store.open(0)
    w = torch.nn.Parameter(torch.zeros(2, 3, dtype=D))
    sink.append(LinearGrad(w, torch.ones(4, 3, dtype=D), torch.ones(4, 2, dtype=D)))
    assert store.pending() == [0]
    store.flush(0)
    assert store.pending() == [] and sink == []
    assert torch.equal(w.grad, torch.full((2, 3), 4.0, dtype=D))
