"""The vision encoder cut into units at its TP all-reduces, like the decoder
(stp.models.decoder.units), so braided blocks (STP paper arXiv 2510.27257, Fig. 3)
interleave encoder units as well.

    pixels+tokens -> InputUnit: patch embedding (row-parallel: each rank holds
                     some of a patch's values) + vocab-parallel text embedding,
                     one all-reduce; finish: RMSNorm of the patch embedding, then
                     the learned position embedding added
    packed x ------> VisionAttentionUnit: x + attn(RMSNorm(x)), full attention
                     (no causal mask), heads split over TP, all-reduce after wo
    packed x ------> VisionMLPUnit: x + fc2(gelu(fc1(RMSNorm(x)))), all-reduce after fc2
    packed x ------> MergerUnit: RMSNorm, merge x merge patches concatenated,
                     fc1 (col) -> gelu -> fc2 (row) into the decoder width
                     (Qwen2-VL's patch merger, arXiv 2409.12191), all-reduce

Every unit takes and returns the packed hidden state (stp.shapes.mllm):
[b, image_tokens + T, hidden], image rows first. The encoder's units work on
the image rows only; the text rows (the caption's embedding) pass through.
The norm is RMSNorm (Qwen2.5-VL's vision tower; Qwen2-VL uses LayerNorm), so
the deferred-gain TP pieces of the decoder serve here too. Positions: a
learned absolute embedding (ViT, Dosovitskiy et al., arXiv 2010.11929) where
Qwen2-VL uses 2-D rotary embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stp.models.decoder.units import Unit
from stp.models.recompute import attention_core
from stp.models.tp.layers import linear, rms_norm, vocab_embedding_partial
from stp.models.tp.wgrad import EmbedGrad, LinearGrad, WGradEntry, accumulate_grad
from stp.models.unit import _MbState
from stp.shapes.mllm import MLLMConfig, VisionConfig

__all__ = ["InputUnit", "VisionAttentionUnit", "VisionMLPUnit", "MergerUnit",
           "pack", "unpack", "patchify"]


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
    one [b, image_tokens + T, hidden] tensor (image rows zero padded)."""
    vc = cfg.vision
    rows = vis.reshape(vis.shape[0], vc.image_tokens, vc.merged_width)
    rows = F.pad(rows, (0, cfg.hidden - vc.merged_width))
    return torch.cat([rows, text.to(rows.dtype)], dim=1)


def unpack(x: torch.Tensor, cfg: MLLMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: (encoder state, text rows)."""
    vc = cfg.vision
    n = vc.image_tokens
    vis = x[:, :n, : vc.merged_width].reshape(x.shape[0], vc.vision_tokens, vc.hidden)
    return vis, x[:, n:]


@dataclass
class AddGrad:
    """W of a tensor added to every sample (position embedding): dP += sum_b dy."""

    weight: torch.Tensor
    grad_out: torch.Tensor

    def accumulate(self) -> None:
        accumulate_grad(self.weight, self.grad_out.sum(0))


class InputUnit(Unit):
    """Stage 0: patch embedding (row-parallel over the patch values), text embedding
    (vocab-parallel), summed by one all-reduce; the finish normalises each patch's
    embedding (RMSNorm, so a patch's content reaches the encoder at unit scale, not at
    the tiny scale of a freshly initialised projection of sparse pixels) and adds the
    position embedding. No input gradient (bytes and token ids)."""

    def __init__(self, cfg: MLLMConfig, patch_w: torch.Tensor, patch_cols: tuple[int, int],
                 patch_norm: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor,
                 vocab_start: int) -> None:
        super().__init__("input")
        self.cfg, self.patch_w, self.cols, self.pos = cfg, patch_w, patch_cols, pos
        self.patch_norm, self.embed, self.vocab_start = patch_norm, embed, vocab_start

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor:
        st = self._enter(mb, None, "F-partial")
        pixels, tokens = x[:, : self.cfg.vision.pixels], x[:, self.cfg.vision.pixels:]
        patches = patchify(pixels, self.cfg.vision, self.patch_w.dtype)
        local = patches[..., self.cols[0]: self.cols[1]].contiguous()
        vis = local @ self.patch_w.detach().t()
        text, owned, rows = vocab_embedding_partial(tokens, self.embed.detach(), self.vocab_start)
        st.saved.update(patches=local, owned=owned, rows=rows)
        return pack(vis, text, self.cfg)

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        vis, text = unpack(reduced, self.cfg)
        with torch.enable_grad():
            v_in = vis.detach().requires_grad_(True)
            h = rms_norm(v_in, self.patch_norm, self.cfg.vision.norm_eps, st.sink)
        st.saved.update(v_in=v_in, h=h)
        return pack(h.detach() + self.pos.detach(), text, self.cfg)

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        gvis, gtext = unpack(grad, self.cfg)
        owned, rows = st.saved.pop("owned"), st.saved.pop("rows")
        (grad_v,) = torch.autograd.grad(st.saved.pop("h"), st.saved.pop("v_in"), gvis)
        st.sink.append(LinearGrad(self.patch_w, st.saved.pop("patches"), grad_v))
        st.sink.append(AddGrad(self.pos, gvis))  # type: ignore[arg-type]
        st.sink.append(EmbedGrad(self.embed, rows[owned], gtext[owned]))
        return None

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        self._enter(mb, "B-partial", "B")
        self._close(mb)
        return None


class _VisionResidual(Unit):
    """image rows v -> v + f(RMSNorm(v)), f ending in a row-parallel matrix; text rows
    pass through. Two autograd graphs (norm, body) with the all-reduce between, as the
    decoder's residual units; with full recomputation (stp.models.recompute) the
    forward keeps its packed input alone and B runs it again with the graphs."""

    def __init__(self, name: str, cfg: MLLMConfig, norm_w: torch.Tensor) -> None:
        super().__init__(name)
        self.cfg, self.norm_w = cfg, norm_w

    def _body(self, h: torch.Tensor, sink: list[WGradEntry]) -> torch.Tensor:
        raise NotImplementedError

    def _graph(self, st: _MbState, vis: torch.Tensor) -> torch.Tensor:
        """The norm and the body on the image rows with their graphs, kept for B."""
        with torch.enable_grad():
            v_in = vis.detach().requires_grad_(True)
            h = rms_norm(v_in, self.norm_w, self.cfg.vision.norm_eps, st.sink)
            h_in = h.detach().requires_grad_(True)
            out = self._body(h_in, st.sink)
        st.saved.update(v_in=v_in, h=h, h_in=h_in, out=out)
        return out

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor:
        st = self._enter(mb, None, "F-partial")
        vis, text = unpack(x, self.cfg)
        if self.recompute == "full":  # the same Functions without a graph: the same bits
            st.saved["x"] = x
            with torch.no_grad():
                return self._body(rms_norm(vis, self.norm_w, self.cfg.vision.norm_eps, []), [])
        st.saved.update(vis=vis, text=text)
        return self._graph(st, vis).detach()

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        if self.recompute == "full":
            vis, text = unpack(st.saved["x"], self.cfg)
        else:
            vis, text = st.saved.pop("vis"), st.saved.pop("text")
        return pack(vis + reduced, text, self.cfg)

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":
            self._graph(st, unpack(st.saved.pop("x"), self.cfg)[0])
        gvis, gtext = unpack(grad, self.cfg)
        (grad_h,) = torch.autograd.grad(st.saved.pop("out"), st.saved.pop("h_in"), gvis)
        st.saved.update(gvis=gvis, gtext=gtext)
        return grad_h

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        (grad_v,) = torch.autograd.grad(st.saved.pop("h"), st.saved.pop("v_in"), reduced)
        out = pack(st.saved.pop("gvis") + grad_v, st.saved.pop("gtext"), self.cfg)
        self._close(mb)
        return out


class VisionAttentionUnit(_VisionResidual):
    """Full (bidirectional) multi-head attention over this rank's heads."""

    def __init__(self, layer: int, cfg: MLLMConfig, norm_w: torch.Tensor, wq: torch.Tensor,
                 wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor) -> None:
        super().__init__(f"vision.blocks.{layer}.attn", cfg, norm_w)
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo

    def _body(self, h: torch.Tensor, sink: list[WGradEntry]) -> torch.Tensor:
        b, s, _ = h.shape
        hd = self.cfg.vision.hidden // self.cfg.vision.num_heads
        q, k, v = (linear(h, w, sink).view(b, s, -1, hd).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = attention_core(q, k, v, causal=False, recompute=self.recompute)
        return linear(o.transpose(1, 2).reshape(b, s, -1), self.wo, sink)


class VisionMLPUnit(_VisionResidual):
    """fc2(gelu(fc1 h)) over this rank's slice of the MLP width (tanh GELU)."""

    def __init__(self, layer: int, cfg: MLLMConfig, norm_w: torch.Tensor, fc1: torch.Tensor,
                 fc2: torch.Tensor) -> None:
        super().__init__(f"vision.blocks.{layer}.mlp", cfg, norm_w)
        self.fc1, self.fc2 = fc1, fc2

    def _body(self, h: torch.Tensor, sink: list[WGradEntry]) -> torch.Tensor:
        return linear(F.gelu(linear(h, self.fc1, sink), approximate="tanh"), self.fc2, sink)


class MergerUnit(Unit):
    """RMSNorm per patch, each merge window's patches concatenated, a 2-layer MLP into
    the decoder width; the image rows become image tokens, text rows pass through.
    Full recomputation: as the encoder's residual units."""

    def __init__(self, cfg: MLLMConfig, norm_w: torch.Tensor, fc1: torch.Tensor,
                 fc2: torch.Tensor) -> None:
        super().__init__("vision.merger")
        self.cfg, self.norm_w, self.fc1, self.fc2 = cfg, norm_w, fc1, fc2

    def _mlp(self, h: torch.Tensor, sink: list[WGradEntry]) -> torch.Tensor:
        vc = self.cfg.vision
        merged = h.reshape(h.shape[0], vc.image_tokens, vc.merged_width)
        a = F.gelu(linear(merged, self.fc1, sink), approximate="tanh")
        return linear(a, self.fc2, sink)  # [b, image_tokens, hidden], partial over TP

    def _graph(self, st: _MbState, vis: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            v_in = vis.detach().requires_grad_(True)
            h = rms_norm(v_in, self.norm_w, self.cfg.vision.norm_eps, st.sink)
            h_in = h.detach().requires_grad_(True)
            out = self._mlp(h_in, st.sink)
        st.saved.update(v_in=v_in, h=h, h_in=h_in, out=out)
        return out

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor:
        st = self._enter(mb, None, "F-partial")
        vis, text = unpack(x, self.cfg)
        if self.recompute == "full":
            st.saved["x"] = x
            with torch.no_grad():
                return self._mlp(rms_norm(vis, self.norm_w, self.cfg.vision.norm_eps, []), [])
        st.saved["text"] = text
        return self._graph(st, vis).detach()

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        text = (unpack(st.saved["x"], self.cfg)[1] if self.recompute == "full"
                else st.saved.pop("text"))
        return torch.cat([reduced, text], dim=1)

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":
            self._graph(st, unpack(st.saved.pop("x"), self.cfg)[0])
        n = self.cfg.vision.image_tokens
        (grad_h,) = torch.autograd.grad(st.saved.pop("out"), st.saved.pop("h_in"), grad[:, :n])
        st.saved["gtext"] = grad[:, n:]
        return grad_h

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        (grad_v,) = torch.autograd.grad(st.saved.pop("h"), st.saved.pop("v_in"), reduced)
        out = pack(grad_v, st.saved.pop("gtext"), self.cfg)
        self._close(mb)
        return out
