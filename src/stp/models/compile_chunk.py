"""One compiled graph per direction for a whole layer chunk (stp.models.decoder.chunk:
a stage's attention and MLP units at one TP rank, where no all-reduce sits
between them), the attention core inside.

The forward graph runs every layer (norm, q/k/v, rotation, the CPU flash
attention kernel, output projection, residual add; norm, SwiGLU MLP, residual
add) and returns, beside the stream, exactly the tensors the eager ops keep for
B. The input-gradient graph (B) walks them back and returns the input gradient
and every linear's output gradient, which the Function hands to the unit's
deferred-W sink as (x, dy) records, as the eager linears' gradient edges do; W
multiplies them where the schedule puts it. A full BW in plain autograd (no
sink) calls a third graph that returns the weight gradients too.

So B is one autograd node and one compiled call per microbatch and stage, the
engine walks nothing else, and TorchDynamo is entered once per pass instead of
once per piece. The matrices that read the same input run as one matmul each
way (stp.models.compile_pieces.one_matmul), and so do their weight gradients
in a full BW's graph: 9 matmuls a layer fewer. Eligible: CPU tensors (the
flash kernel named here is the CPU one), recompute "none" or "full" (selective
recomputation replaces the attention core, so those chunks keep the pieces of
stp.models.compile_pieces).
"""

from __future__ import annotations

from typing import Any

import torch

from stp.models.compile_pieces import (
    _rows,
    mlp_backward,
    mlp_forward,
    norm_backward,
    norm_forward,
    qkv_rope_backward,
    qkv_rope_forward,
)
from stp.models.tp.wgrad import LinearGrad, NormGrad, WGradEntry

_ATEN = torch.ops.aten

ATTN, MLP = "attn", "mlp"
"""A layer's kind in a chunk's spec: (ATTN, eps, head_dim) or (MLP, eps, 0)."""

ATTN_PARAMS = 10  # g, wq, wk, wv, wo, bq, bk, bv, cos, sin
MLP_PARAMS = 4    # g, w1, w3, w2
ATTN_KEPT = 9     # h, xhat, rstd, q, k, v, o, lse, o2
MLP_KEPT = 7      # h, xhat, rstd, gate, act, up, a


def _param_count(kind: str) -> int:
    return ATTN_PARAMS if kind == ATTN else MLP_PARAMS


def _attn_forward(x: torch.Tensor, p: tuple, eps: float, head_dim: int) -> tuple:
    g, wq, wk, wv, wo, bq, bk, bv, cos, sin = p
    h, xhat, rstd = norm_forward(x, g, eps)
    q, k, v = qkv_rope_forward(h, wq, wk, wv, bq, bk, bv, cos, sin, head_dim)
    o, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    b, _, s, _ = o.shape
    o2 = o.transpose(1, 2).reshape(b, s, -1)
    return o2 @ wo.t(), (h, xhat, rstd, q, k, v, o, lse, o2)


def _mlp_forward(x: torch.Tensor, p: tuple, eps: float) -> tuple:
    g, w1, w3, w2 = p
    h, xhat, rstd = norm_forward(x, g, eps)
    out, gate, act, up, a = mlp_forward(h, w1, w3, w2)
    return out, (h, xhat, rstd, gate, act, up, a)


def chunk_forward(x: torch.Tensor, params: tuple, spec: tuple,
                  keep_streams: bool) -> tuple:
    """(h: the stream before the last residual add, last: the last branch, then each
    layer's kept tensors, then, with keep_streams, each layer's input stream: what
    the eager norm keeps in a plain-autograd full BW)."""
    kept: list[Any] = []
    streams: list[torch.Tensor] = []
    h, i, last = x, 0, x
    for n, (kind, eps, head_dim) in enumerate(spec):
        p = params[i:i + _param_count(kind)]
        i += len(p)
        if n:
            h = h + last
        streams.append(h)
        last, saved = (_attn_forward(h, p, eps, head_dim) if kind == ATTN
                       else _mlp_forward(h, p, eps))
        kept.extend(saved)
    return (h, last, *kept, *(streams if keep_streams else ()))


def _attn_backward(dy: torch.Tensor, p: tuple, saved: tuple) -> tuple:
    """(dx, the norm's dh, dy of wq, wk, wv)."""
    g, wq, wk, wv, wo, _, _, _, cos, sin = p
    _, xhat, rstd, q, k, v, o, lse, _ = saved
    b, s, _ = dy.shape
    do = (dy @ wo).view(b, s, q.shape[1], -1).transpose(1, 2)
    dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True)
    dh, dyq, dyk, dyv = qkv_rope_backward(dq, dk, dv, wq, wk, wv, cos, sin)
    return norm_backward(dh, xhat, rstd, g), dh, dyq, dyk, dyv


def _mlp_backward(dy: torch.Tensor, p: tuple, saved: tuple) -> tuple:
    """(dx, the norm's dh, dy of w1, w3)."""
    g, w1, w3, w2 = p
    _, xhat, rstd, gate, act, up, _ = saved
    dh, dgate, dup = mlp_backward(dy, gate, act, up, w1, w3, w2)
    return norm_backward(dh, xhat, rstd, g), dh, dgate, dup


def _layer_slices(spec: tuple) -> list[tuple[int, int]]:
    """(first parameter, first kept tensor) of each layer."""
    out, i, j = [], 0, 0
    for kind, _, _ in spec:
        out.append((i, j))
        i += _param_count(kind)
        j += ATTN_KEPT if kind == ATTN else MLP_KEPT
    return out


def chunk_backward(grad_h: torch.Tensor, grad_last: torch.Tensor, params: tuple,
                   kept: tuple, spec: tuple) -> tuple:
    """(dx, then per layer: the stream gradient at its output (the dy of its last
    matrix), the norm's dh and its first matrices' dys)."""
    per_layer: list[tuple] = []
    stream, dy = grad_h, grad_last
    for n in range(len(spec) - 1, -1, -1):
        kind = spec[n][0]
        i, j = _layer_slices(spec)[n]
        p = params[i:i + _param_count(kind)]
        saved = kept[j:j + (ATTN_KEPT if kind == ATTN else MLP_KEPT)]
        dx, *rest = (_attn_backward if kind == ATTN else _mlp_backward)(dy, p, saved)
        per_layer.append((dy, *rest))
        stream = stream + dx
        dy = stream
    return (stream, *(t for layer in reversed(per_layer) for t in layer))


def _linears(kind: str, p: tuple, saved: tuple, grads: tuple) -> tuple:
    """(position in p of the weight, of the bias or None, the input x, dy) of each matrix
    of a layer, and dh of its norm (whose gain is p[0] and xhat saved[1]), from
    chunk_backward's grads of that layer."""
    if kind == ATTN:
        h, o2 = saved[0], saved[8]
        dyo, dh, dyq, dyk, dyv = grads
        return ((1, 5, h, dyq), (2, 6, h, dyk), (3, 7, h, dyv), (4, None, o2, dyo)), dh
    h, a = saved[0], saved[6]
    dy2, dh, dgate, dup = grads
    return ((1, None, h, dgate), (2, None, h, dup), (3, None, a, dy2)), dh


def _layers(spec: tuple, params: tuple, kept: tuple, flat: tuple):
    """Per layer: (first parameter's index, its parameters, its kept tensors, its
    gradients from chunk_backward)."""
    at = 0
    for n, (i, j) in enumerate(_layer_slices(spec)):
        kind = spec[n][0]
        width = 5 if kind == ATTN else 4
        yield (kind, i, params[i:i + _param_count(kind)],
               kept[j:j + (ATTN_KEPT if kind == ATTN else MLP_KEPT)], tuple(flat[at:at + width]))
        at += width


def chunk_backward_w(grad_h: torch.Tensor, grad_last: torch.Tensor, params: tuple,
                     kept: tuple, spec: tuple) -> tuple:
    """chunk_backward with the weight gradients in the same graph (a plain-autograd full
    BW): (dx, then one gradient per entry of params, None for the rotary tables and
    absent biases)."""
    dx, *flat = chunk_backward(grad_h, grad_last, params, kept, spec)
    out: list[torch.Tensor | None] = [None] * len(params)
    for kind, i, p, saved, grads in _layers(spec, params, kept, tuple(flat)):
        linears, dh = _linears(kind, p, saved, grads)
        xhat = saved[1]
        out[i] = _rows(dh.to(xhat.dtype) * xhat).sum(0).to(p[0].dtype)
        shared, last = linears[:-1], linears[-1]  # the first ones read the norm's h
        dy = _rows(torch.cat([dy for _, _, _, dy in shared], -1))
        dws = (dy.t() @ _rows(shared[0][2])).split([p[w].shape[0] for w, *_ in shared])
        for (w, bias, _, _), dw, db in zip(shared, dws, dy.sum(0).split(
                [p[w].shape[0] for w, *_ in shared]), strict=True):
            out[i + w] = dw.to(p[w].dtype)
            if bias is not None and p[bias] is not None:
                out[i + bias] = db
        w, _, x, dy_last = last
        out[i + w] = (_rows(dy_last).t() @ _rows(x)).to(p[w].dtype)
    return (dx, *out)


class ChunkFn(torch.autograd.Function):
    """A layer chunk's forward and B as one node (the module doc): saves the tensors the
    eager ops save and hands W its (x, dy) records, or, without a sink, returns the
    weight gradients from the same backward graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: tuple, sink: list[WGradEntry] | None,
                kernels: Any, *params: torch.Tensor | None):
        # not detached: a Function's forward runs without grad already, and the same
        # graph serves a forward without one (one detach per tensor and call saved)
        out = kernels.chunk_forward(x, params, spec, sink is None)
        h, last = out[0], out[1]
        ctx.n_kept = len(out) - 2 - (len(spec) if sink is None else 0)
        ctx.param_slots = tuple(i for i, t in enumerate(params) if t is not None)
        ctx.save_for_backward(*out[2:], *(params[i] for i in ctx.param_slots))
        ctx.spec, ctx.sink, ctx.kernels, ctx.n_params = spec, sink, kernels, len(params)
        return h, last

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor, grad_last: torch.Tensor):
        saved = ctx.saved_tensors
        kept = saved[:ctx.n_kept]
        params: list[torch.Tensor | None] = [None] * ctx.n_params
        for slot, t in zip(ctx.param_slots, saved[len(saved) - len(ctx.param_slots):],
                           strict=True):
            params[slot] = t
        head = (None, None, None)  # spec, sink, kernels
        if ctx.sink is None:
            dx, *grads = ctx.kernels.chunk_backward_w(grad_h, grad_last, tuple(params), kept,
                                                      ctx.spec)
            needs = ctx.needs_input_grad[4:]
            return (dx, *head, *(g if need else None for g, need in zip(grads, needs,
                                                                         strict=True)))
        dx, *flat = ctx.kernels.chunk_backward(grad_h, grad_last, tuple(params), kept, ctx.spec)
        _record(ctx.sink, ctx.spec, tuple(params), kept, flat)
        return (dx, *head, *(None,) * ctx.n_params)


def _record(sink: list[WGradEntry], spec: tuple, params: tuple, kept: tuple,
            flat: list[torch.Tensor]) -> None:
    """W's records of every layer, as the eager linears and norms make them."""
    for kind, _, p, saved, grads in _layers(spec, params, kept, tuple(flat)):
        linears, dh = _linears(kind, p, saved, grads)
        sink.append(NormGrad(p[0], saved[1], dh))
        sink.extend(LinearGrad(p[w], x, dy, None if bias is None else p[bias])
                    for w, bias, x, dy in linears)
