"""A stage's document-masking tables, one set per microbatch of the step.

With document masking (stp.models.documents) every attention unit of a stage
rotates q and k at the tokens' positions within their documents and masks
attention across documents. The tables are the same for every layer of a
microbatch, so the stage computes them once per step (`load`) and its attention
units look them up; `current` names the microbatch the unit computing now
works on (units of two microbatches interleave when braided, so each sets it at
its entry points; a rank runs one unit at a time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stp.models.decoder.rope import RopeCache
from stp.models.documents import Documents

__all__ = ["DocumentMasks"]


class DocumentMasks:
    """Per microbatch: cos and sin at the document positions [b, 1, s, hd] (they
    broadcast over the heads as the plain tables [s, hd] do) and the attention
    mask [b, 1, s, s]."""

    def __init__(self, rope: RopeCache) -> None:
        self.rope = rope
        self.current = 0
        self._tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def load(self, docs: Sequence[Documents], device: torch.device, dtype: torch.dtype) -> None:
        """The tables of a step's microbatches, in microbatch order."""
        seq = docs[0].position.shape[1]
        cos, sin = self.rope.get(seq, device, dtype)
        self._tables = []
        for d in docs:
            at = d.position.to(device)
            self._tables.append((cos[at].unsqueeze(1), sin[at].unsqueeze(1),
                                 d.attention_mask().to(device)))

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, mask) of the current microbatch."""
        if self.current >= len(self._tables):
            raise RuntimeError(f"document masking: no tables for microbatch {self.current} "
                               f"({len(self._tables)} loaded this step)")
        return self._tables[self.current]
