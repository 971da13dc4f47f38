"""At one TP rank a stage runs its layers as one unit (stp.models.decoder.chunk.LayerChunk).
It must compute what the per-layer units compute: the same outputs, input
gradients and weight gradients, for a split backward (B now, W later: the weight
gradients caught through gradient edges) and for a full one (plain autograd)."""

from __future__ import annotations

import pytest
import torch

from stp.models import ModelConfig, StagePlacement, build_stage
from stp.models.decoder.chunk import LayerChunk

D = torch.float64
CFG = ModelConfig(vocab_size=32, hidden=32, num_layers=6, num_heads=4, num_kv_heads=2,
                  ffn_hidden=64, max_seq_len=16, seed=5, qkv_bias=True)


def _run(stage_index: int, fuse: bool, at_once: tuple[int, ...]) -> tuple[list, dict]:
    """Forward two microbatches through one stage of three, B of both, then W."""
    st = build_stage(CFG, StagePlacement(stage_index, 3, dtype=D), fuse_layers=fuse)
    assert any(isinstance(u, LayerChunk) for u in st.units) == fuse
    st.weights_in_backward(at_once)
    g = torch.Generator().manual_seed(stage_index)
    outs = []
    for mb in range(2):
        if st.is_first:
            x = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
        else:
            x = torch.randn(2, 9, CFG.hidden, generator=g, dtype=D)
        targets = torch.randint(0, CFG.vocab_size, (2, 9), generator=g) if st.is_last else None
        outs.append(st.forward(mb, x, targets))
    for mb in range(2):
        grad = None if st.is_last else torch.randn(2, 9, CFG.hidden, generator=g, dtype=D)
        outs.append(st.backward_input(mb, grad, 0.5))
    assert all(p.grad is None for p in st.parameters())  # B leaves .grad to W
    for mb in range(2):
        st.backward_weight(mb)
    assert st.pending_backward() == [] and st.pending_weight() == []
    return outs, {n: p.grad.clone() for n, p in st.named_parameters()}


@pytest.mark.parametrize("at_once", [(), (0, 1), (1,)], ids=["split", "full", "mixed"])
@pytest.mark.parametrize("stage_index", [0, 1, 2], ids=["first", "middle", "last"])
def test_fused_layers_equal_the_per_layer_units(stage_index: int, at_once: tuple[int, ...]):
    want_out, want_grads = _run(stage_index, False, at_once)
    got_out, got_grads = _run(stage_index, True, at_once)
    for w, g in zip(want_out, got_out, strict=True):
        if w is None:
            assert g is None
        else:
            assert torch.allclose(w, g, rtol=1e-12, atol=1e-14)
    assert want_grads.keys() == got_grads.keys()
    for name, w in want_grads.items():
        assert torch.allclose(w, got_grads[name], rtol=1e-12, atol=1e-14), name
