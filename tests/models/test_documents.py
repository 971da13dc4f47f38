"""Document masking's layout: segments, positions, targets and the attention mask
derived from token ids alone (stp.models.documents), against a hand count and
against attention run on each document alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stp.models.documents import Documents
from stp.shapes.decoder import IGNORE_INDEX

E = 9  # the end-of-sequence id of these examples


def test_the_module_docs_example_by_hand() -> None:
    a, b, c, d, e, f, g = 1, 2, 3, 4, 5, 6, 7
    tokens = torch.tensor([[a, b, E, c, d, e, E, f]])
    docs = Documents.from_tokens(tokens, E)
    assert docs.segment.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert docs.position.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    targets = torch.tensor([[b, E, c, d, e, E, f, g]])
    assert docs.targets(targets).tolist() == [[b, E, IGNORE_INDEX, d, e, E, IGNORE_INDEX, g]]
    mask = docs.attention_mask()[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[7].tolist() == [False] * 7 + [True]
    assert docs.mean_length() == 8 / 3


def test_a_row_starts_a_document_and_an_eos_at_the_row_end_closes_one() -> None:
    tokens = torch.tensor([[3, 4, E, 5], [6, E, E, 7], [E, 1, 2, 3]])
    docs = Documents.from_tokens(tokens, E)
    assert docs.position.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0], [0, 0, 1, 2]]
    assert docs.segment.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2], [0, 1, 1, 1]]
    assert docs.targets(torch.zeros(3, 4, dtype=torch.long)).eq(IGNORE_INDEX).tolist() == [
        [False, False, True, False], [False, True, True, False], [True, False, False, False]]
    two = docs.microbatch(1, 2)
    assert two.segment.tolist() == [[0, 1, 1, 1]]


def _rope(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE at the given positions [b, s] of x [b, h, s, d]."""
    d = x.shape[-1]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position[:, None, :, None].double() * torch.cat([inv, inv])
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * angle.cos() + half * angle.sin()


def test_masked_attention_at_document_positions_equals_each_document_alone() -> None:
    torch.manual_seed(0)
    tokens = torch.tensor([[1, 2, E, 3, 4, 5, E, 6, 7, 8], [E, 1, 1, 1, 1, E, 2, 2, E, 3]])
    b, s, heads, dim = 2, tokens.shape[1], 2, 8
    q, k, v = (torch.randn(b, heads, s, dim, dtype=torch.float64) for _ in range(3))
    docs = Documents.from_tokens(tokens, E)
    packed = F.scaled_dot_product_attention(_rope(q, docs.position), _rope(k, docs.position),
                                            v, attn_mask=docs.attention_mask())
    for row in range(b):
        for seg in docs.segment[row].unique().tolist():
            cols = (docs.segment[row] == seg).nonzero().flatten()
            at = torch.arange(len(cols))[None]
            alone = F.scaled_dot_product_attention(
                _rope(q[row:row + 1, :, cols], at), _rope(k[row:row + 1, :, cols], at),
                v[row:row + 1, :, cols], is_causal=True)
            torch.testing.assert_close(packed[row:row + 1, :, cols], alone, rtol=0, atol=1e-12)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(packed, plain)  # the mask changes what a packed row computes
