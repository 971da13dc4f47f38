"""Where the documents of a packed batch lie, for document masking.

Training data is packed: documents joined with the end-of-sequence token and cut
into rows of `seq_len` tokens, so a row holds the tail of one document, whole
documents, and the head of another. Plain causal attention lets a token attend
across those boundaries; document masking (Megatron-LM's
`--reset-attention-mask --reset-position-ids`, Hugging Face's packing with
`position_ids`) keeps each token to the earlier tokens of its own document,
restarts its position at 0 at each document start, and trains no prediction
across a boundary.

All three are functions of the token ids alone, so every pipeline stage, which
receives the same global batch, derives them itself; nothing extra is sent.

    tokens     a  b  E  c  d  e  E  f        (E: the end-of-sequence id)
    segment    0  0  0  1  1  1  1  2        (E closes its document)
    position   0  1  2  0  1  2  3  0
    targets    b  E  -  d  e  E  -  g        (- : IGNORE_INDEX; E's next token opens
                                              another document)

A row's first token starts a segment whatever precedes it (the tail of a
document cut by the row boundary restarts at position 0, as each row is
trained alone).

With rotary embeddings a query-key score depends only on the distance between
the two positions, so under the mask the restart changes no score in exact
arithmetic; it is kept because it is what Hugging Face and Megatron-LM compute
(the same bits as a document run alone) and what an absolute position scheme
would need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stp.shapes.decoder import IGNORE_INDEX

__all__ = ["Documents"]


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of rows [b, s] (see the module doc)."""

    segment: torch.Tensor
    """[b, s] int64: the document index of each token within its row, from 0."""
    position: torch.Tensor
    """[b, s] int64: each token's offset within its document (its RoPE position)."""
    ends: torch.Tensor
    """[b, s] bool: the last token of a document (the end-of-sequence token)."""

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eos_id: int) -> Documents:
        """The layout of `tokens` [b, s], documents closed by `eos_id`."""
        if tokens.dim() != 2:
            raise ValueError(f"document masking reads token rows [b, s], got shape "
                             f"{tuple(tokens.shape)}")
        ends = tokens == eos_id
        closed = ends.long()
        segment = torch.cumsum(closed, dim=1) - closed  # EOS belongs to the document it ends
        starts = torch.zeros_like(ends)
        starts[:, 0] = True
        starts[:, 1:] = ends[:, :-1]
        index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return cls(segment, index - first, ends)

    def targets(self, targets: torch.Tensor) -> torch.Tensor:
        """`targets` with IGNORE_INDEX where a document ends: its next token opens
        another document, which nothing before it may predict."""
        return targets.masked_fill(self.ends, IGNORE_INDEX)

    def attention_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True where query i may attend key j: the same document,
        and j <= i (the form F.scaled_dot_product_attention's `attn_mask` takes)."""
        same = self.segment[:, :, None] == self.segment[:, None, :]
        s = self.segment.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=self.segment.device).tril()
        return (same & causal)[:, None]

    def microbatch(self, index: int, size: int) -> Documents:
        """Rows [index * size, (index + 1) * size) (one microbatch of a step)."""
        rows = slice(index * size, (index + 1) * size)
        return Documents(self.segment[rows], self.position[rows], self.ends[rows])

    def mean_length(self) -> float:
        """Mean tokens per document piece (a document cut by a row boundary counts
        once in each row): what the cost model prices masked attention by."""
        pieces = int(self.segment[:, -1].sum()) + self.segment.shape[0]
        return self.segment.numel() / pieces
