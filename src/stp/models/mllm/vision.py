"""The vision encoder cut into units at its TP all-reduces, like the decoder
(stp.models.decoder.units), so braided blocks (STP paper arXiv 2510.27257, Fig. 3)
interleave encoder units as well. The input unit and the packed stream's
layout (`pack`, `unpack`, `patchify`) are stp.models.mllm.vision_input.

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

Under sequence parallelism (arXiv 2205.05198; stp.models.mllm.rows) a unit
takes and returns this TP rank's rows of the packed tensor, each all-reduce
above is a reduce-scatter, and each encoder unit's TP region starts with an
all-gather of the normalised image rows (the input unit's backward gathers
its gradient instead: the dual of its forward's reduce-scatter).

Activation recomputation (stp.models.recompute) works as in the decoder's
units: `selective` recomputes the encoder attention's core in B, `full` keeps
a residual unit's or the merger's input rows alone and runs the unit again,
all-gather included, at the start of its B (`_ImageUnit`); the input unit keeps
its small inputs (patch values, token masks) either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stp.models.decoder.units import Unit
from stp.models.mllm.rows import gather_input, image_of, image_rows, local_image, spread
from stp.models.mllm.vision_input import pack, unpack
from stp.models.recompute import attention_core
from stp.models.tp.layers import linear, rms_norm
from stp.models.tp.sequence import PendingGather, ToScatter
from stp.models.tp.wgrad import WGradEntry
from stp.models.unit import _MbState
from stp.shapes.mllm import MLLMConfig

__all__ = ["VisionAttentionUnit", "VisionMLPUnit", "MergerUnit"]


class _ImageUnit(Unit):
    """What the encoder's residual units and the merger share: the unit starts with
    RMSNorm of the image rows (per patch; this rank's rows under sequence parallelism),
    then, under SP, the all-gather of the normalised patches (stp.models.mllm.rows),
    launched early when the braid runner prepares the unit (stp.runtime.braid), then
    the unit's TP body (`_body`) on every patch.

    With full recomputation (stp.models.recompute) the forward runs the same
    functions without a graph and keeps its packed input rows alone; B first runs
    the forward again with its graphs (`_rebuild`: norm, all-gather, body, so W
    still gets (x, dy) of every matrix), then walks them as it would have. Under
    SP the rebuild's all-gather is launched by `prepare_backward` after the output
    gradient's (every TP rank issues them in one order), as the decoder's units do
    (stp.models.decoder.units)."""

    def __init__(self, name: str, cfg: MLLMConfig, norm_w: torch.Tensor) -> None:
        super().__init__(name)
        self.cfg, self.norm_w = cfg, norm_w

    def _body(self, h: torch.Tensor, sink: list[WGradEntry]) -> torch.Tensor:
        raise NotImplementedError

    def _norm_graph(self, st: _MbState, vis: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the image rows with its graph (v_in a fresh leaf), kept for B."""
        with torch.enable_grad():
            v_in = vis.detach().requires_grad_(True)
            h = rms_norm(v_in, self.norm_w, self.cfg.vision.norm_eps, st.sink)
        st.saved.update(v_in=v_in, h=h)
        return h

    def _norm(self, mb: int, x: torch.Tensor) -> tuple[_MbState, torch.Tensor]:
        st = self._enter(mb, None, "F-partial")
        k = image_rows(self.cfg, self.seq, x.shape[1])
        vis, text = unpack(x, self.cfg, k)
        st.saved["rows"] = (k, x.shape[1])
        if self.recompute == "full":  # keep the input alone; the same Functions, no graph
            st.saved["x"] = x
            with torch.no_grad():
                return st, rms_norm(vis, self.norm_w, self.cfg.vision.norm_eps, [])
        st.saved.update(vis=vis, text=text)
        return st, self._norm_graph(st, vis)

    def _gather(self, h: torch.Tensor, st: _MbState) -> PendingGather:
        assert self.seq is not None
        return gather_input(self.seq, h.detach(), self.cfg, st.saved["rows"][1])

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        if self.seq is not None:
            st, h = self._norm(mb, x)
            st.saved["gather"] = self._gather(h, st)

    def _patches(self, mb: int, x: torch.Tensor) -> tuple[_MbState, torch.Tensor]:
        """(state, the normalised patches [b, vision_tokens, vision hidden]: a leaf that
        requires grad, the input of the unit's TP body)."""
        st = self._states.get(mb)
        if st is not None and "gather" in st.saved:  # prepare_forward ran
            h_in = image_of(st.saved.pop("gather").wait(), self.cfg)
        else:
            st, h = self._norm(mb, x)
            h_in = h.detach() if self.seq is None else image_of(self._gather(h, st).wait(),
                                                                self.cfg)
        return st, h_in.requires_grad_(True)

    def _body_graph(self, st: _MbState, h_in: torch.Tensor) -> torch.Tensor:
        """The TP body on the gathered patches as a graph of its own; kept as h_in, out."""
        with torch.enable_grad():
            out = self._body(h_in.requires_grad_(True), st.sink)
        st.saved.update(h_in=h_in, out=out)
        return out

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor | ToScatter:
        st, h_in = self._patches(mb, x)
        if self.recompute == "full":  # B computes it again (`_rebuild`)
            with torch.no_grad():
                out = self._body(h_in, [])
        else:
            out = self._body_graph(st, h_in)
        return out.detach() if self.seq is None else self._spread(out.detach(), st)

    def _rebuild_norm(self, st: _MbState) -> torch.Tensor:
        return self._norm_graph(st, unpack(st.saved.pop("x"), self.cfg, st.saved["rows"][0])[0])

    def _rebuild(self, st: _MbState) -> None:
        """Full recomputation, at the start of B: the forward again from the kept input
        rows, with the graphs (and W's records) the forward without it keeps."""
        pending = st.saved.pop("rebuild_gather", None)  # prepare_backward ran
        if pending is None:
            h = self._rebuild_norm(st)
            if self.seq is None:
                self._body_graph(st, h.detach())
                return
            pending = self._gather(h, st)  # waited at once: nothing to hide it under
        self._body_graph(st, image_of(pending.wait(), self.cfg))

    def _grad_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """What of this rank's output gradient rows the backward all-gathers."""
        return grad

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        """SP: launch the output gradient's all-gather; with full recomputation also
        rebuild the norm and launch the all-gather of its rows, so both fly under the
        partner's next item (stp.runtime.braid's advance)."""
        st = self._states.get(mb)
        if self.seq is None or st is None or st.phase != "F":
            return
        st.saved["grad_gather"] = self.seq.launch_gather(self._grad_rows(grad))
        if self.recompute == "full":
            st.saved["rebuild_gather"] = self._gather(self._rebuild_norm(st), st)

    def _grad_gathered(self, st: _MbState, grad: torch.Tensor) -> torch.Tensor:
        """The whole output gradient under SP (prepare_backward's gather, or one now)."""
        assert self.seq is not None
        pending = st.saved.pop("grad_gather", None)  # prepare_backward ran
        if pending is None:
            pending = self.seq.launch_gather(self._grad_rows(grad))
        return pending.wait()

    def _local(self, reduced: torch.Tensor, st: _MbState) -> torch.Tensor:
        """The image rows of a reduced tensor that are this rank's (all without SP)."""
        return reduced if self.seq is None else local_image(reduced, self.cfg,
                                                            st.saved["rows"][0])

    def _spread(self, partial: torch.Tensor, st: _MbState) -> ToScatter:
        """An image-rows partial sum as the whole packed sequence to reduce-scatter."""
        assert self.seq is not None
        return spread(partial, self.cfg, st.saved["rows"][1] * self.seq.size)

    def _norm_backward(self, st: _MbState, reduced: torch.Tensor) -> torch.Tensor:
        (grad_v,) = torch.autograd.grad(st.saved.pop("h"), st.saved.pop("v_in"),
                                        self._local(reduced, st))
        return grad_v


class _VisionResidual(_ImageUnit):
    """image rows v -> v + f(RMSNorm(v)), f ending in a row-parallel matrix; text rows
    pass through. Two autograd graphs (norm, body) with the all-reduce (SP: the
    reduce-scatter, then the next unit's all-gather) between, as the decoder's
    residual units."""

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        if self.recompute == "full":  # the input stays kept for B
            vis, text = unpack(st.saved["x"], self.cfg, st.saved["rows"][0])
        else:
            vis, text = st.saved.pop("vis"), st.saved.pop("text")
        return pack(vis + self._local(reduced, st), text, self.cfg)

    def _grad_rows(self, grad: torch.Tensor) -> torch.Tensor:
        return grad[..., : self.cfg.vision.merged_width]  # the image rows' width

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | ToScatter:
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":
            self._rebuild(st)
        k = st.saved["rows"][0]
        gvis, gtext = unpack(grad, self.cfg, k)
        full = gvis if self.seq is None else image_of(self._grad_gathered(st, grad), self.cfg)
        (grad_h,) = torch.autograd.grad(st.saved.pop("out"), st.saved.pop("h_in"), full)
        st.saved.update(gvis=gvis, gtext=gtext)
        return grad_h if self.seq is None else self._spread(grad_h, st)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        assert reduced is not None
        grad_v = self._norm_backward(st, reduced)
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


class MergerUnit(_ImageUnit):
    """RMSNorm per patch, each merge window's patches concatenated, a 2-layer MLP into
    the decoder width; the image rows become image tokens, text rows pass through.
    Under SP its backward gathers the image tokens' gradient at the decoder's width
    (the whole output gradient). Full recomputation: as the encoder's residual units."""

    def __init__(self, cfg: MLLMConfig, norm_w: torch.Tensor, fc1: torch.Tensor,
                 fc2: torch.Tensor) -> None:
        super().__init__("vision.merger", cfg, norm_w)
        self.fc1, self.fc2 = fc1, fc2

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor | ToScatter:
        out = super().forward_partial(mb, x, targets)
        self._states[mb].saved.pop("vis", None)  # the image rows become image tokens
        return out

    def _body(self, h: torch.Tensor, sink: list[WGradEntry]) -> torch.Tensor:
        vc = self.cfg.vision
        merged = h.reshape(h.shape[0], vc.image_tokens, vc.merged_width)
        a = F.gelu(linear(merged, self.fc1, sink), approximate="tanh")
        return linear(a, self.fc2, sink)  # [b, image_tokens, hidden], partial over TP

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        k = st.saved["rows"][0]
        # full recomputation: the input stays kept for B
        text = st.saved["x"][:, k:] if self.recompute == "full" else st.saved.pop("text")
        return torch.cat([reduced[:, :k], text], dim=1)

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | ToScatter:
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":
            self._rebuild(st)
        k = st.saved["rows"][0]
        full = grad if self.seq is None else self._grad_gathered(st, grad)
        n = self.cfg.vision.image_tokens
        (grad_h,) = torch.autograd.grad(st.saved.pop("out"), st.saved.pop("h_in"), full[:, :n])
        st.saved["gtext"] = grad[:, k:]
        return grad_h if self.seq is None else self._spread(grad_h, st)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        assert reduced is not None
        grad_v = self._norm_backward(st, reduced)
        out = pack(grad_v, st.saved.pop("gtext"), self.cfg)
        self._close(mb)
        return out
