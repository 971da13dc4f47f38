"""Document masking in a step: each local stage gets the layout of this
replica's microbatches, and the targets across a document boundary are ignored.

The layout is a function of the token ids alone (stp.models.documents), and every
rank is handed the same global batch, so each rank derives it for itself: a
middle pipeline stage, which never sees the tokens as its input, masks the same
documents as the first. Evaluation masks the same way as training.
"""

from __future__ import annotations

import torch

from stp.models.documents import Documents
from stp.train.data.corpus import split_batch
from stp.train.run.parts import Parts

__all__ = ["mask_documents"]


def mask_documents(parts: Parts, tokens: torch.Tensor, targets: torch.Tensor,
                   num_microbatches: int) -> torch.Tensor:
    """Load the step's document tables into this rank's stages; the global batch's
    targets with each document's last prediction ignored. Without document masking
    (`TrainerOptions.document_eos` None) the targets unchanged."""
    eos = parts.options.document_eos
    if eos is None:
        return targets
    docs = Documents.from_tokens(tokens, eos)
    d, c = parts.dims, parts.mesh.coord
    cut = [split_batch(t, d.dp, c.dp, num_microbatches)
           for t in (docs.segment, docs.position, docs.ends)]
    mine = [Documents(*rows) for rows in zip(*cut, strict=True)]
    for stage in parts.stages.values():
        stage.load_documents(mine)
    return docs.targets(targets)
