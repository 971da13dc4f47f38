"""Where the multimodal stream starts: pixels cut into patches (`patchify`), the
packed hidden state every unit takes and returns (`pack`, `unpack`:
[b, image_tokens + T, hidden], image rows first; stp.shapes.mllm), and the
stage-0 unit that makes it (`InputUnit`: patch and text embeddings summed by
one all-reduce, then the patch norm and the position embedding). The encoder's
other units are stp.models.mllm.vision."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stp.models.decoder.units import Unit
from stp.models.mllm.rows import image_rows, local_image
from stp.models.tp.layers import rms_norm, vocab_embedding_partial
from stp.models.tp.sequence import ToScatter
from stp.models.tp.wgrad import EmbedGrad, LinearGrad, accumulate_grad
from stp.models.unit import _MbState
from stp.shapes.mllm import MLLMConfig, VisionConfig

__all__ = ["AddGrad", "InputUnit", "pack", "patchify", "unpack"]


def patchify(pixels: torch.Tensor, vc: VisionConfig, dtype: torch.dtype) -> torch.Tensor:
    """Pixel bytes [b, H*W*C] -> patches [b, vision_tokens, patch_dim], scaled to [0, 1]
    (a black background is then zero and adds nothing to the patch embedding).
    Patches are ordered window by window (each merge x merge window's patches
    consecutive, row-major inside and across windows), so the merger's windows
    are plain reshapes; a patch's values are (row, column, channel) row-major."""
    b, p, m = pixels.shape[0], vc.patch_size, vc.merge
    g = vc.image_size // (p * m)
    img = pixels.reshape(b, g, m, p, g, m, p, vc.channels)
    img = img.permute(0, 1, 4, 2, 5, 3, 6, 7)  # b, wi, wj, a, c, py, px, C
    return img.reshape(b, vc.vision_tokens, vc.patch_dim).to(dtype) / 255.0


def pack(vis: torch.Tensor, text: torch.Tensor, cfg: MLLMConfig) -> torch.Tensor:
    """Encoder state [b, vision_tokens, vision hidden] and text rows [b, T, hidden] ->
    one [b, image_tokens + T, hidden] tensor (image rows zero padded); also a rank's
    rows under sequence parallelism (k merge windows, then its text rows)."""
    vc = cfg.vision
    rows = vis.reshape(vis.shape[0], -1, vc.merged_width)
    rows = F.pad(rows, (0, cfg.hidden - vc.merged_width))
    return torch.cat([rows, text.to(rows.dtype)], dim=1)


def unpack(x: torch.Tensor, cfg: MLLMConfig,
           k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: (encoder state, text rows); `k`: x's image rows (default
    all, image_tokens; fewer in a rank's rows under sequence parallelism,
    stp.models.mllm.rows)."""
    k = cfg.vision.image_tokens if k is None else k
    return local_image(x, cfg, k), x[:, k:]


@dataclass
class AddGrad:
    """W of a tensor added to every sample (position embedding): dP += sum_b dy, into
    rows [start, start + rows of dy) of P (a rank's rows under sequence parallelism)."""

    weight: torch.Tensor
    grad_out: torch.Tensor
    start: int = 0

    def accumulate(self) -> None:
        g = self.grad_out.sum(0)
        if g.shape == self.weight.shape:
            accumulate_grad(self.weight, g)
            return
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        self.weight.grad.narrow(0, self.start, g.shape[0]).add_(g.to(self.weight.dtype))


class InputUnit(Unit):
    """Stage 0: patch embedding (row-parallel over the patch values), text embedding
    (vocab-parallel), summed by one all-reduce; the finish normalises each patch's
    embedding (RMSNorm, so a patch's content reaches the encoder at unit scale, not at
    the tiny scale of a freshly initialised projection of sparse pixels) and adds the
    position embedding. No input gradient (bytes and token ids).

    Sequence parallelism (stp.models.mllm.rows): the sum is a reduce-scatter, the
    finish runs on this rank's rows, and the backward all-gathers the gradient of the
    summed embeddings (the dual of that reduce-scatter) for the patch and text
    embeddings' W."""

    def __init__(self, cfg: MLLMConfig, patch_w: torch.Tensor, patch_cols: tuple[int, int],
                 patch_norm: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor,
                 vocab_start: int) -> None:
        super().__init__("input")
        self.cfg, self.patch_w, self.cols, self.pos = cfg, patch_w, patch_cols, pos
        self.patch_norm, self.embed, self.vocab_start = patch_norm, embed, vocab_start

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor | ToScatter:
        st = self._enter(mb, None, "F-partial")
        pixels, tokens = x[:, : self.cfg.vision.pixels], x[:, self.cfg.vision.pixels:]
        patches = patchify(pixels, self.cfg.vision, self.patch_w.dtype)
        local = patches[..., self.cols[0]: self.cols[1]].contiguous()
        vis = local @ self.patch_w.detach().t()
        text, owned, rows = vocab_embedding_partial(tokens, self.embed.detach(), self.vocab_start)
        st.saved.update(patches=local, owned=owned, rows=rows)
        return self._handoff(pack(vis, text, self.cfg))

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        vc = self.cfg.vision
        k = image_rows(self.cfg, self.seq, reduced.shape[1])
        # the first of this rank's patches (SP: the rows before its own hold the others)
        start = 0 if self.seq is None else min(
            self.seq.rank * reduced.shape[1] * vc.merge**2, vc.vision_tokens)
        vis, text = unpack(reduced, self.cfg, k)
        with torch.enable_grad():
            v_in = vis.detach().requires_grad_(True)
            h = rms_norm(v_in, self.patch_norm, vc.norm_eps, st.sink)
        st.saved.update(v_in=v_in, h=h, span=(k, start))
        pos = self.pos.detach()[start: start + vis.shape[1]]
        return pack(h.detach() + pos, text, self.cfg)

    def _local_backward(self, st: _MbState, grad: torch.Tensor) -> torch.Tensor:
        """This rank's part of the backward: the norm's, the position embedding's W;
        the gradient of the summed embeddings (packed) for the all-gather."""
        k, start = st.saved.pop("span")
        gvis, gtext = unpack(grad, self.cfg, k)
        (grad_v,) = torch.autograd.grad(st.saved.pop("h"), st.saved.pop("v_in"), gvis)
        pos_w = AddGrad(self.pos, gvis, start)
        st.sink.append(pos_w)  # type: ignore[arg-type]  # W calls only its accumulate()
        return pack(grad_v, gtext, self.cfg)

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        """SP: the local backward and the all-gather's launch, ahead of backward_partial."""
        st = self._states.get(mb)
        if self.seq is not None and st is not None and st.phase == "F":
            st.saved["grad_gather"] = self.seq.launch_gather(self._local_backward(st, grad))

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        pending = st.saved.pop("grad_gather", None)  # prepare_backward ran
        if pending is not None:
            full = pending.wait()
        else:
            full = self._gathered(self._local_backward(st, grad))
        grad_v, gtext = unpack(full, self.cfg)
        owned, rows = st.saved.pop("owned"), st.saved.pop("rows")
        st.sink.append(LinearGrad(self.patch_w, st.saved.pop("patches"), grad_v))
        st.sink.append(EmbedGrad(self.embed, rows[owned], gtext[owned]))
        return None

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        self._enter(mb, "B-partial", "B")
        self._close(mb)
        return None
