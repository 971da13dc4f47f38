"""Sequence parallelism for the multimodal model (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
section 4.2.2; the collectives are stp.models.tp.sequence's).

The stream between units and stages is one packed tensor [b, S, hidden],
S = image_tokens + T (stp.shapes.mllm): image rows first, each holding one
merge window (merge**2 patches of the encoder's width). Under SP TP rank r
holds rows [r S/t, (r+1) S/t) of it, so its rows are

    k = clamp(image_tokens - r S/t, 0, S/t) image rows, then text rows

and each window stays whole on one rank: the patch sequence itself needs no
divisibility, only S does (stp refuses an S that does not divide by t rather
than padding it; `check_mllm_sequence`). RMSNorm (per patch, per token), the
residual adds and the position embedding run on a rank's own rows.

An encoder unit's TP region needs every patch: it all-gathers the image rows
of its normalised input at the merged width (merge**2 x vision hidden, not
the decoder's), [b, S/t, mw] per rank with its text rows zero, takes the
first image_tokens rows of the [b, S, mw] result as the patch sequence, and
ends in a reduce-scatter of its partial sum laid out the same way (text rows
zero). So the encoder's collectives carry the text rows' zeros too: the price
of one stream layout through the whole pipeline (an encoder stage may hand
its rows straight to a decoder layer on the same stage).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stp.models.tp.sequence import PendingGather, SequenceParallel, ToScatter
from stp.shapes.mllm import MLLMConfig

__all__ = ["check_mllm_sequence", "image_rows", "local_image", "gather_input", "image_of",
           "spread"]


def check_mllm_sequence(cfg: MLLMConfig, text_len: int, tp: int) -> None:
    """ValueError (one line) unless image tokens + caption tokens divide by tp, naming
    the next --seq-len that would: stp refuses rather than pads (a padded row would
    need a mask in the attention and the loss)."""
    n, seq = cfg.vision.image_tokens, cfg.seq_len(text_len)
    if seq % tp:
        fit = text_len + (-seq) % tp
        raise ValueError(
            f"--sequence-parallel splits the multimodal model's sequence over the TP ranks: "
            f"{n} image tokens + --seq-len {text_len} = {seq} is not divisible by --tp {tp} "
            f"(stp refuses rather than pads; --seq-len {fit} would fit)")


def image_rows(cfg: MLLMConfig, seq: SequenceParallel | None, rows: int) -> int:
    """Image rows among a unit's `rows` input rows: all of them without SP, else
    those of this rank's part of the packed sequence."""
    n = cfg.vision.image_tokens
    if seq is None:
        return n
    return min(max(n - seq.rank * rows, 0), rows)


def local_image(x: torch.Tensor, cfg: MLLMConfig, k: int) -> torch.Tensor:
    """The encoder state [b, k merge**2, vision hidden] of the first k rows of x."""
    vc = cfg.vision
    return x[:, :k, : vc.merged_width].reshape(x.shape[0], k * vc.merge**2, vc.hidden)


def spread(t: torch.Tensor, cfg: MLLMConfig, total: int) -> ToScatter:
    """A partial sum over the image rows (patches [b, vision_tokens, vision hidden]
    or image tokens [b, image_tokens, w]) as the packed [b, total, w] tensor with zero
    text rows, to be reduce-scattered into each rank's rows."""
    n = cfg.vision.image_tokens
    packed = t.reshape(t.shape[0], n, -1)
    return ToScatter(F.pad(packed, (0, 0, 0, total - n)))


def gather_input(seq: SequenceParallel, h: torch.Tensor, cfg: MLLMConfig,
                 rows: int) -> PendingGather:
    """Launch the all-gather of this rank's normalised patches h [b, k merge**2, vision
    hidden] (its `rows` rows of the stream, text rows zero); `image_of` reads the
    result."""
    vc = cfg.vision
    packed = h.reshape(h.shape[0], -1, vc.merged_width)
    return seq.launch_gather(F.pad(packed, (0, 0, 0, rows - packed.shape[1])))


def image_of(full: torch.Tensor, cfg: MLLMConfig, patches: bool = True) -> torch.Tensor:
    """The image rows of a gathered [b, S, w] tensor, a fresh leaf: as patches [b,
    vision_tokens, vision hidden] (w = merged width), or as rows [b, image_tokens, w]."""
    vc = cfg.vision
    rows = full[:, : vc.image_tokens]
    if patches:
        rows = rows.reshape(full.shape[0], vc.vision_tokens, vc.hidden)
    return rows.detach()
