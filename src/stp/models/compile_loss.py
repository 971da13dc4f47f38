"""The loss unit (final RMSNorm, head, vocab-parallel cross-entropy) as one compiled
graph per direction, for `stp train --compile` (stp.models.compile).

Eagerly, or with the compiled pieces alone, a microbatch's loss unit is an
autograd graph (the norm's Function, the head's F.linear) walked by the engine
in B, two compiled calls around the head's matmul each way and the loss's
finish in eager ops. Here the unit drives its own backward, so it needs no
autograd graph at all:

    one TP rank   F: norm, head, statistics, finish (loss, lse)     one call
                  B: CE gradient, head's dx, norm's dx              one call
    more ranks    F-partial: norm, head, statistics                 one call
                  B-partial: CE gradient, head's dx (partial sum)   one call
                  B-finish: the norm's dx after the all-reduce      one call

It keeps what the eager unit keeps from F to B (the input, the normalised input
h the head reads, the norm's xhat and rstd, the logits, the targets, the
global logsumexp), and W gets the records the eager linear and norm make: the
head's (h, d logits), the gain's (xhat, dh). A full BW at one TP rank (no
deferral) computes the two weight gradients in the same B graph instead.
Selective or full recomputation and sequence parallelism keep the pieces
(`applies`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stp.models.compile_pieces import _rows, norm_backward, norm_forward
from stp.models.tp.layers import (
    _compute_dtype,
    _logsumexp,
    _valid_columns,
    vocab_ce_finish,
    vocab_ce_grad,
    vocab_ce_stats,
)
from stp.models.tp.wgrad import LinearGrad, NormGrad, ReadyGrad
from stp.shapes.decoder import IGNORE_INDEX

__all__ = ["LossGraphs", "applies"]

# The graphs' maths, without autograd (each is one torch.compile graph).

def loss_forward(x: torch.Tensor, g: torch.Tensor, eps: float, head_w: torch.Tensor,
                 targets: torch.Tensor, vocab_valid: int | None) -> tuple[torch.Tensor, ...]:
    """One TP rank, with the finish: (loss, lse, logits, h, xhat, rstd)."""
    h, xhat, rstd = norm_forward(x, g, eps)
    logits = F.linear(h, head_w)
    # vocab_ce_stats and vocab_ce_finish at one rank without the stacked statistics:
    # inductor would make the kept lse a view of that [2, b, s] buffer
    lf = _valid_columns(logits.to(_compute_dtype(logits.dtype)), vocab_valid)
    lse = _logsumexp(lf, -1)
    picked = lf.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(targets != IGNORE_INDEX, lse - picked, 0.0).mean()
    return loss, lse, logits, h, xhat, rstd


def loss_forward_partial(x: torch.Tensor, g: torch.Tensor, eps: float, head_w: torch.Tensor,
                         targets: torch.Tensor, vocab_start: int, tp_size: int, tp_rank: int,
                         vocab_valid: int | None) -> tuple[torch.Tensor, ...]:
    """More TP ranks, up to the statistics to reduce: (stats, logits, h, xhat, rstd)."""
    h, xhat, rstd = norm_forward(x, g, eps)
    logits = F.linear(h, head_w)
    stats = vocab_ce_stats(logits, targets, vocab_start, tp_size, tp_rank, vocab_valid)
    return stats, logits, h, xhat, rstd


def loss_backward(grad_loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                  lse: torch.Tensor, head_w: torch.Tensor, xhat: torch.Tensor,
                  rstd: torch.Tensor, g: torch.Tensor,
                  vocab_valid: int | None) -> tuple[torch.Tensor, ...]:
    """One TP rank: (dx, dh: the norm's output gradient, d logits: the head's)."""
    grad_logits = vocab_ce_grad(logits, targets, lse, None, grad_loss, vocab_valid)
    dh = grad_logits @ head_w
    return norm_backward(dh, xhat, rstd, g), dh, grad_logits


def loss_backward_w(grad_loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                    lse: torch.Tensor, head_w: torch.Tensor, h: torch.Tensor,
                    xhat: torch.Tensor, rstd: torch.Tensor, g: torch.Tensor,
                    vocab_valid: int | None) -> tuple[torch.Tensor, ...]:
    """loss_backward with the weight gradients (a full BW): (dx, d gain, d head)."""
    dx, dh, grad_logits = loss_backward(grad_loss, logits, targets, lse, head_w, xhat, rstd, g,
                                        vocab_valid)
    dg = _rows(dh.to(xhat.dtype) * xhat).sum(0).to(g.dtype)
    return dx, dg, (_rows(grad_logits).t() @ _rows(h)).to(head_w.dtype)


def loss_backward_partial(grad_loss: torch.Tensor, logits: torch.Tensor,
                          targets: torch.Tensor, lse: torch.Tensor, head_w: torch.Tensor,
                          vocab_start: int, vocab_valid: int | None) -> tuple[torch.Tensor, ...]:
    """More TP ranks: (the head's dh, a partial sum over TP; d logits)."""
    grad_logits = vocab_ce_grad(logits, targets, lse, vocab_start, grad_loss, vocab_valid)
    return grad_logits @ head_w, grad_logits


def applies(unit: Any) -> bool:
    """A loss unit the graphs serve: compiled kernels, no recomputation (it replays the
    unit's autograd forward), no sequence parallelism (its all-gathers sit between the
    norm and the head)."""
    return (getattr(unit.kernels, "loss_graphs", None) is not None
            and unit.recompute == "none" and unit.seq is None)


class LossGraphs:
    """The loss unit's steps on the compiled graphs (`compiled`: a name -> compiled
    function lookup, stp.models.compile.CompiledKernels). `st` is the unit's
    per-microbatch state (stp.models.unit._MbState); every step returns what the
    unit protocol's step of the same name returns."""

    def __init__(self, compiled: Any) -> None:
        self._c = compiled

    def forward_partial(self, unit: Any, st: Any, mb: int, x: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor | None:
        g, w = unit.norm_w.detach(), unit.head_w.detach()
        st.saved.update(x=x, targets=targets)
        if unit.one_graph:  # the all-reduce is the identity: finish in the same graph
            loss, lse, logits, h, xhat, rstd = self._c.loss_forward(
                x, g, unit.eps, w, targets, unit.vocab_valid)
            st.saved.update(loss=loss, lse=lse, logits=logits, h=h, xhat=xhat, rstd=rstd,
                            native=mb in unit.weights_at_once)
            return None  # nothing to reduce
        stats, logits, h, xhat, rstd = self._c.loss_forward_partial(
            x, g, unit.eps, w, targets, unit.vocab_start, unit.tp_size, unit.tp_rank,
            unit.vocab_valid)
        st.saved.update(logits=logits, h=h, xhat=xhat, rstd=rstd)
        return stats

    @staticmethod
    def forward_finish(st: Any, reduced: torch.Tensor | None) -> torch.Tensor:
        if "loss" in st.saved:
            return st.saved.pop("loss")
        loss, st.saved["lse"] = vocab_ce_finish(reduced, st.saved["targets"])
        return loss.detach()

    def backward_partial(self, unit: Any, st: Any, grad: torch.Tensor) -> torch.Tensor | None:
        # one element, not 0-dim: TorchDynamo guards a 0-dim float tensor by value
        # (a host read per call)
        grad = grad.reshape(1)
        s = st.saved
        logits, targets, lse = s.pop("logits"), s.pop("targets"), s.pop("lse")
        g, w, h = unit.norm_w, unit.head_w, s.pop("h")
        if not unit.one_graph:
            dh, grad_logits = self._c.loss_backward_partial(
                grad, logits, targets, lse, w.detach(), unit.vocab_start, unit.vocab_valid)
            st.sink.append(LinearGrad(w, h, grad_logits))
            return unit._handoff(dh)
        xhat, rstd = s.pop("xhat"), s.pop("rstd")
        del s["x"]
        if s.pop("native"):  # a full BW: the weight gradients now, W only adds them
            dx, dg, dw = self._c.loss_backward_w(grad, logits, targets, lse, w.detach(), h,
                                                 xhat, rstd, g.detach(), unit.vocab_valid)
            st.sink.extend(ReadyGrad(p, d) for p, d in ((g, dg), (w, dw)) if p.requires_grad)
        else:
            dx, dh, grad_logits = self._c.loss_backward(grad, logits, targets, lse, w.detach(),
                                                        xhat, rstd, g.detach(),
                                                        unit.vocab_valid)
            st.sink.extend((NormGrad(g, xhat, dh), LinearGrad(w, h, grad_logits)))
        s["grad"] = dx
        return None

    def backward_finish(self, unit: Any, st: Any, reduced: torch.Tensor) -> torch.Tensor:
        """More TP ranks: the norm's B on the reduced gradient (the gain's record needs
        it, so W after an early W adds it at the unit's close)."""
        xhat, rstd = st.saved.pop("xhat"), st.saved.pop("rstd")
        del st.saved["x"]
        st.sink.append(NormGrad(unit.norm_w, xhat, reduced))
        return self._c.norm_backward(reduced, xhat, rstd, unit.norm_w.detach())
