"""The whole multimodal model in one process, no TP, plain autograd: the parity
reference for the unit stages (stp.models.mllm.stage).

Written independently of the units: images are cut into patches with
torch.nn.functional.unfold (channel-first) and reordered window by window,
attention is an explicit softmax, GELU is written out, the merge is a gather
of each window's patches, and the decoder is stp.models.decoder.reference's own model
(itself independent of the decoder units), fed embeddings instead of tokens.
Parameters have the stages' global names and initial values (mllm_init).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stp.models.decoder.reference import ReferenceModel
from stp.models.mllm.stage import mllm_init, mllm_specs
from stp.shapes.decoder import IGNORE_INDEX
from stp.shapes.mllm import MLLMConfig

__all__ = ["MLLMReference", "build_mllm_reference"]


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class MLLMReference(nn.Module):
    """Encoder (normalised patch embedding + positions, blocks, merger) and the decoder
    reference over [image tokens, caption tokens], mean cross-entropy over non-ignored
    targets."""

    def __init__(self, cfg: MLLMConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        specs = mllm_specs(cfg)
        full = {s.name: mllm_init(cfg, s, dtype) for s in specs}
        dec = {k: v for k, v in full.items() if not k.startswith("vision.")}
        self.decoder = ReferenceModel(cfg.decoder, dtype, dec)
        self.vision = nn.ParameterDict({
            k.removeprefix("vision.").replace(".", "__"): nn.Parameter(v)
            for k, v in full.items() if k.startswith("vision.")})

    def _p(self, name: str) -> torch.Tensor:
        return self.vision[name.replace(".", "__")]

    def named_full(self) -> dict[str, torch.Tensor]:
        """Every parameter under the stages' global names."""
        out = {"vision." + k.replace("__", "."): v for k, v in self.vision.items()}
        out.update(dict(self.decoder.named_parameters()))
        return out

    def _patches(self, pixels: torch.Tensor) -> torch.Tensor:
        vc = self.cfg.vision
        b, s, p, m = pixels.shape[0], vc.image_size, vc.patch_size, vc.merge
        img = pixels.view(b, s, s, vc.channels).permute(0, 3, 1, 2)
        img = img.to(self._p("patch_embed.weight"))
        cols = F.unfold(img, kernel_size=p, stride=p)  # [b, C*p*p, grid*grid], channel-first
        grid = s // p
        # to (row, column, channel) order inside a patch
        cols = cols.view(b, vc.channels, p * p, grid * grid).transpose(1, 2).reshape(b, -1, grid**2)
        order = [(wi * m + a) * grid + wj * m + c for wi in range(grid // m)
                 for wj in range(grid // m) for a in range(m) for c in range(m)]
        return cols.transpose(1, 2)[:, order] / 255.0  # pixel values in [0, 1]

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        vc, b, n = self.cfg.vision, h.shape[0], h.shape[1]
        a, hd = vc.num_heads, vc.hidden // vc.num_heads
        q, k, v = (F.linear(h, self._p(f"blocks.{i}.attn.{w}.weight")).view(b, n, a, hd)
                   .transpose(1, 2) for w in ("wq", "wk", "wv"))
        o = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).softmax(-1) @ v
        return F.linear(o.transpose(1, 2).reshape(b, n, -1), self._p(f"blocks.{i}.attn.wo.weight"))

    def image_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel bytes [b, P] -> image tokens [b, image_tokens, hidden]."""
        vc = self.cfg.vision
        x = self._patches(pixels) @ self._p("patch_embed.weight").t()
        x = _rms(x, self._p("patch_norm.weight"), vc.norm_eps) + self._p("pos_embed")
        for i in range(vc.num_layers):
            x = x + self._attention(i, _rms(x, self._p(f"blocks.{i}.norm1.weight"), vc.norm_eps))
            h = _rms(x, self._p(f"blocks.{i}.norm2.weight"), vc.norm_eps)
            x = x + F.linear(_gelu(F.linear(h, self._p(f"blocks.{i}.mlp.fc1.weight"))),
                             self._p(f"blocks.{i}.mlp.fc2.weight"))
        h = _rms(x, self._p("merger.norm.weight"), vc.norm_eps)
        h = h.reshape(h.shape[0], vc.image_tokens, -1)
        return F.linear(_gelu(F.linear(h, self._p("merger.fc1.weight"))),
                        self._p("merger.fc2.weight"))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """inputs [b, P + T] (pixel bytes, caption tokens), targets [b, image_tokens + T]."""
        cfg, dec = self.cfg, self.decoder
        pixels, tokens = inputs[:, : cfg.vision.pixels], inputs[:, cfg.vision.pixels:]
        x = torch.cat([self.image_tokens(pixels), dec.embed.weight[tokens]], dim=1)
        c = cfg.decoder
        for i in range(c.num_layers):
            x = x + dec._attention(i, _rms(x, dec.get_parameter(f"layers.{i}.attn_norm.weight"),
                                           c.norm_eps))
            x = x + dec._mlp(i, _rms(x, dec.get_parameter(f"layers.{i}.mlp_norm.weight"),
                                     c.norm_eps))
        logits = F.linear(_rms(x, dec.norm.weight, c.norm_eps), dec.head.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(inputs, targets)


def build_mllm_reference(cfg: MLLMConfig, dtype: torch.dtype = torch.float32) -> MLLMReference:
    """The whole multimodal model with the stages' names and initial values."""
    if not isinstance(cfg, MLLMConfig):
        raise ValueError(f"cfg must be an MLLMConfig, got {type(cfg).__name__}")
    return MLLMReference(cfg, dtype)
