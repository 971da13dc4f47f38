"""The whole MoE decoder in one process, plain autograd: the parity reference.

The decoder's reference (stp.models.decoder.reference: attention, norms, head,
loss) with each MoE layer's MLP computed as transformers' Qwen2-MoE / Mixtral
blocks do, written apart from the units (a one-hot expert mask, a loop over
the experts hit, `index_add_`), so that the stages agreeing with it checks the
routing, the TP split of the experts and the split backward of the router.

Two load-balancing numbers (stp.models.moe.routing says why they differ):
- `hf_aux_loss(tokens)`: transformers' `aux_loss` (all layers' router logits of
  the whole batch concatenated);
- `aux_loss(tokens, chunks)`: what stp trains and reports: the per-layer loss,
  averaged over the MoE layers and over the batch cut into `chunks` equal runs
  of rows (the microbatches of every DP replica).
`objective(tokens, targets, chunks)` = loss + aux_loss_coef x aux_loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stp.models.decoder.reference import ReferenceModel
from stp.models.moe.init import moe_parameter_specs
from stp.shapes.moe import MoEConfig

__all__ = ["MoEReference", "build_moe_reference"]


class MoEReference(ReferenceModel):
    """Embed, L x (attention; dense MLP or routed experts), norm, head; see the module doc."""

    config: MoEConfig

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(config, dtype, tensors, moe_parameter_specs(config))
        self.router_logits: list[torch.Tensor] = []
        """Each MoE layer's router logits [b * s, E] of the last forward."""

    def _swiglu(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        p = self._params
        gate = F.silu(F.linear(x, p[prefix + "w1.weight"]))
        return F.linear(gate * F.linear(x, p[prefix + "w3.weight"]), p[prefix + "w2.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        c, p = self.config, self._params
        if not c.is_moe_layer(i):
            return super()._mlp(i, h)
        b, s, d = h.shape
        x = h.reshape(-1, d)
        m = f"layers.{i}.moe."
        logits = F.linear(x, p[m + "router.weight"])
        self.router_logits.append(logits)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        top, chosen = torch.topk(probs, c.top_k, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, c.num_experts).permute(2, 1, 0)  # [E, k, n]
        for e in range(c.num_experts):
            slot, token = torch.where(mask[e])
            y = self._swiglu(f"{m}experts.{e}.", x[token]) * top[token, slot, None]
            out = out.index_add(0, token, y)
        if c.shared_expert_ffn:
            gate = torch.sigmoid(F.linear(x, p[m + "shared_gate.weight"]))
            out = out + gate * self._swiglu(m + "shared.", x)
        return out.view(b, s, d)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self.router_logits = []
        return super().logits(tokens)

    def _layer_aux(self, logits: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's loss of one set of router logits [n, E]."""
        c = self.config
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        chosen = torch.topk(probs, c.top_k, dim=-1).indices
        share = F.one_hot(chosen, c.num_experts).sum(1).to(probs.dtype).mean(0)  # f_e
        return c.num_experts * (share * probs.mean(0)).sum()

    def hf_aux_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """transformers' aux_loss: every layer's router logits concatenated."""
        self.logits(tokens)
        return self._layer_aux(torch.cat(self.router_logits))

    def _chunked_aux(self, rows: int, chunks: int) -> torch.Tensor:
        """The mean over MoE layers and over `chunks` equal runs of the last forward's
        rows (routing is per token, so one forward of the whole batch gives every
        chunk's logits) of the per-layer loss."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or rows % chunks:
            raise ValueError(f"{rows} rows do not split into chunks={chunks!r} equal parts")
        per = self.router_logits[0].shape[0] // chunks
        return torch.stack([self._layer_aux(part) for layer in self.router_logits
                            for part in layer.split(per)]).mean()

    def aux_loss(self, tokens: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        """stp's load-balancing loss of a batch cut into `chunks` microbatches."""
        self.logits(tokens)
        return self._chunked_aux(tokens.shape[0], chunks)

    def objective(self, tokens: torch.Tensor, targets: torch.Tensor,
                  chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(the language-model loss, the load-balancing loss) of one forward; training
        minimises loss + aux_loss_coef x aux."""
        loss = self.loss(tokens, targets)
        return loss, self._chunked_aux(tokens.shape[0], chunks)


def build_moe_reference(config: MoEConfig, dtype: torch.dtype = torch.float32,
                        tensors: dict[str, torch.Tensor] | None = None) -> MoEReference:
    """The full MoE model with the stages' names and initial values."""
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
    return MoEReference(config, dtype, tensors)
