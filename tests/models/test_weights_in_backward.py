"""A stage told which microbatches get a full backward (`weights_in_backward`, the
executor reads it off the schedule) runs them in plain autograd at one TP rank: B
gets the weight gradients in the same graph walk. Same gradients as the deferred
path, and B still leaves `.grad` alone until W."""

from __future__ import annotations

import pytest
import torch

from stp.models import ModelConfig, StagePlacement, build_stage

D = torch.float64
CFG = ModelConfig(vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  ffn_hidden=64, max_seq_len=16, seed=7, qkv_bias=True)
SCALE = 0.5


def batch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + mb)
    return (torch.randint(0, CFG.vocab_size, (2, 7), generator=g),
            torch.randint(0, CFG.vocab_size, (2, 7), generator=g))


def run(num_stages: int, at_once: tuple[int, ...]) -> tuple[list[float], list[dict]]:
    """Forward two microbatches, B of both, then W; the gradients per stage. Checks on
    the way that B touched no `.grad` and what B kept for W."""
    stages = [build_stage(CFG, StagePlacement(s, num_stages, dtype=D)) for s in range(num_stages)]
    for st in stages:
        st.weights_in_backward(at_once)
    losses = []
    for mb in range(2):
        x, targets = batch(mb)
        for st in stages:
            x = st.forward(mb, x, targets if st.is_last else None)
        losses.append(x.item())
    for mb in range(2):
        g = None
        for st in reversed(stages):
            g = st.backward_input(mb, g, SCALE)
            extra = {tuple(t.shape) for t in st.kept_tensors(mb)} - {
                tuple(p.shape) for p in st.parameters()}
            rows = {(14,), (14, CFG.hidden)} if st.is_first else set()  # the embedding's
            if mb in at_once:  # ready weight gradients only
                assert extra == rows, (mb, extra)
            else:  # activations and output gradients for W's matmuls
                assert extra - rows, mb
    for st in stages:
        assert all(p.grad is None for p in st.parameters())
        for mb in range(2):
            st.backward_weight(mb)
    return losses, [{n: p.grad.clone() for n, p in st.named_parameters()} for st in stages]


@pytest.mark.parametrize("num_stages", [1, 2])
def test_full_backward_microbatches_give_the_deferred_gradients(num_stages: int):
    losses, want = run(num_stages, ())
    for at_once in ((0, 1), (1,)):
        got_losses, got = run(num_stages, at_once)
        assert got_losses == losses
        for w, g in zip(want, got, strict=True):
            assert w.keys() == g.keys()
            for name in w:
                err = (w[name] - g[name]).abs().max().item()
                assert err <= 1e-12 * w[name].abs().max().item(), (name, err)
