"""The compiled pieces of `stp train --compile` (stp.models.compile): each piece's maths
as a forward function and a backward function without autograd (what
torch.compile turns into one kernel graph each), and the autograd Function of
stp's own that calls them, saves exactly what the eager ops save, and hands
each linear's (x, dy) to the unit's deferred-W sink (stp.models.tp.wgrad), or,
without a sink (a plain-autograd full BW), returns the weight gradients.

`kernels` in these Functions is stp.models.compile.CompiledKernels: the compiled
forms of the functions below, one set per process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stp.models.compile_weights import norm_kept_input, norm_weight_work, weight_work
from stp.models.decoder.rope import apply_rope
from stp.models.tp.wgrad import WGradEntry

# The kernels: the eager maths of stp.models.tp.layers and stp.models.decoder.rope,
# split into forward and backward functions without autograd.

def norm_forward(x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    return (xhat * weight).to(x.dtype), xhat, rstd


def norm_backward(grad_out: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
    dxhat = grad_out.to(xhat.dtype) * weight
    grad_x = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return grad_x.to(grad_out.dtype)


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def unrotate(u: torch.Tensor) -> torch.Tensor:
    """The transpose of rotate_half (x1, x2 -> -x2, x1): u1, u2 -> u2, -u1."""
    u1, u2 = u.chunk(2, dim=-1)
    return torch.cat([u2, -u1], dim=-1)


def rope_backward(gq: torch.Tensor, gk: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gq * cos + unrotate(gq * sin), gk * cos + unrotate(gk * sin)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    act = F.silu(gate)
    return act * up, act


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, act: torch.Tensor,
                     up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sig = torch.sigmoid(gate)  # silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
    return grad * up * (sig * (1 + gate * (1 - sig))), grad * act


class NormFn(torch.autograd.Function):
    """stp.models.tp.layers._RMSNormFn with compiled kernels: saves xhat and rstd, defers
    the gain's gradient to the sink; without a sink (a full BW in plain autograd)
    returns it instead and keeps what the eager ops keep (`norm_kept_input`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                sink: list[WGradEntry] | None, kernels: Any):
        y, xhat, rstd = kernels.norm_forward(x.detach(), weight.detach(), eps)
        ctx.save_for_backward(xhat, rstd, weight, *norm_kept_input(x, sink))
        ctx.sink, ctx.kernels = sink, kernels
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors[:3]
        grad_w = norm_weight_work(ctx.sink, ctx.needs_input_grad[1], weight, xhat, grad_out)
        grad_x = ctx.kernels.norm_backward(grad_out, xhat, rstd, weight.detach())
        return grad_x, grad_w, None, None, None


class RopeFn(torch.autograd.Function):
    """Rotary embedding of q and k in one kernel each way; saves the tables only, as the
    eager multiplications do."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kernels: Any):
        ctx.save_for_backward(cos, sin)
        ctx.kernels = kernels
        return kernels.rope_forward(q.detach(), k.detach(), cos, sin)

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return (*ctx.kernels.rope_backward(gq, gk, cos, sin), None, None, None)


class SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up in one kernel; saves gate, silu(gate) and up, as the eager ops do."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kernels: Any):
        gate, up = gate.detach(), up.detach()
        out, act = kernels.swiglu_forward(gate, up)
        ctx.save_for_backward(gate, act, up)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        gate, act, up = ctx.saved_tensors
        return (*ctx.kernels.swiglu_backward(grad, gate, act, up), None)


def one_matmul(x: torch.Tensor) -> bool:
    """Whether the matrices that read the same input (q, k, v; gate, up) run as one
    matmul in the graphs, their weights concatenated there (the parameters stay
    apart): on the CPU, where a matmul call costs more than the copy; a GPU keeps
    them apart (the copy would read the weights a second time). The input gradient
    then sums over the concatenated rows in one matmul instead of adding three: a
    different rounding (float64 agrees with the eager units to about 1e-16)."""
    return x.device.type == "cpu"


def _concat_linear(h: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   biases: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
    """Each F.linear(h, w, b), from one matmul; copied out of it, so that a tensor B
    keeps holds its own bytes, as the eager linear's output does."""
    bias = None if biases[0] is None else torch.cat(biases)
    y = F.linear(h, torch.cat(weights), bias)
    return [t.contiguous() for t in y.split([w.shape[0] for w in weights], dim=-1)]


def qkv_rope_forward(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                      bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                      cos: torch.Tensor, sin: torch.Tensor,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, s, _ = h.shape
    if one_matmul(h):
        qkv = _concat_linear(h, (wq, wk, wv), (bq, bk, bv))
    else:
        qkv = [F.linear(h, w, bias) for w, bias in ((wq, bq), (wk, bk), (wv, bv))]
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in qkv)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def qkv_rope_backward(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, wq: torch.Tensor,
                       wk: torch.Tensor, wv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dh, and the output gradients of the q, k, v projections [b, s, heads * hd])."""
    gq, gk = gq * cos + unrotate(gq * sin), gk * cos + unrotate(gk * sin)
    b, _, s, _ = gq.shape
    dq, dk, dv = (g.transpose(1, 2).reshape(b, s, -1) for g in (gq, gk, gv))
    if one_matmul(dq):
        return torch.cat((dq, dk, dv), -1) @ torch.cat((wq, wk, wv)), dq, dk, dv
    return dq @ wq + dk @ wk + dv @ wv, dq, dk, dv


def mlp_forward(h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(out, and what B needs: the gate, silu(gate), the up projection, w2's input)."""
    gate, up = (_concat_linear(h, (w1, w3), (None, None)) if one_matmul(h)
                else (F.linear(h, w1), F.linear(h, w3)))
    act = F.silu(gate)
    a = act * up
    return F.linear(a, w2), gate, act, up, a


def mlp_backward(dy: torch.Tensor, gate: torch.Tensor, act: torch.Tensor, up: torch.Tensor,
                  w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, and the output gradients of w1 and w3)."""
    dgate, dup = swiglu_backward(dy @ w2, gate, act, up)
    if one_matmul(dy):
        return torch.cat((dgate, dup), -1) @ torch.cat((w1, w3)), dgate, dup
    return dgate @ w1 + dup @ w3, dgate, dup


def norm_qkv_rope_forward(x: torch.Tensor, g: torch.Tensor, eps: float, wq: torch.Tensor,
                          wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor | None,
                          bk: torch.Tensor | None, bv: torch.Tensor | None, cos: torch.Tensor,
                          sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
    """RMSNorm, then qkv_rope_forward: (q, k, v, and for B h, xhat, rstd)."""
    h, xhat, rstd = norm_forward(x, g, eps)
    return (*qkv_rope_forward(h, wq, wk, wv, bq, bk, bv, cos, sin, head_dim), h, xhat, rstd)


def norm_qkv_rope_backward(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor,
                           wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, xhat: torch.Tensor,
                           rstd: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dx, dh: the norm's output gradient, and the projections' output gradients)."""
    dh, dq, dk, dv = qkv_rope_backward(gq, gk, gv, wq, wk, wv, cos, sin)
    return norm_backward(dh, xhat, rstd, g), dh, dq, dk, dv


def norm_mlp_forward(x: torch.Tensor, g: torch.Tensor, eps: float, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RMSNorm, then mlp_forward: (out, gate, act, up, a, and for B h, xhat, rstd)."""
    h, xhat, rstd = norm_forward(x, g, eps)
    return (*mlp_forward(h, w1, w3, w2), h, xhat, rstd)


def norm_mlp_backward(dy: torch.Tensor, gate: torch.Tensor, act: torch.Tensor, up: torch.Tensor,
                      w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, xhat: torch.Tensor,
                      rstd: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dx, dh: the norm's output gradient, and the output gradients of w1 and w3)."""
    dh, dgate, dup = mlp_backward(dy, gate, act, up, w1, w3, w2)
    return norm_backward(dh, xhat, rstd, g), dh, dgate, dup


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def norm_qkv_rope_backward_w(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor,
                             h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                             wv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             xhat: torch.Tensor, rstd: torch.Tensor, g: torch.Tensor,
                             biased: bool) -> tuple[torch.Tensor | None, ...]:
    """norm_qkv_rope_backward with the weight gradients in the same graph (a plain-autograd
    full BW): (dx, dg, dWq, dWk, dWv, dbq, dbk, dbv; the biases' None if not biased)."""
    dx, dh, *dys = norm_qkv_rope_backward(gq, gk, gv, wq, wk, wv, cos, sin, xhat, rstd, g)
    dg = _rows(dh.to(xhat.dtype) * xhat).sum(0).to(g.dtype)
    dws = [(_rows(dy).t() @ _rows(h)).to(w.dtype) for w, dy in zip((wq, wk, wv), dys,
                                                                   strict=True)]
    dbs = [_rows(dy).sum(0) if biased else None for dy in dys]
    return dx, dg, *dws, *dbs


def norm_mlp_backward_w(dy: torch.Tensor, h: torch.Tensor, gate: torch.Tensor,
                        act: torch.Tensor, up: torch.Tensor, a: torch.Tensor, w1: torch.Tensor,
                        w3: torch.Tensor, w2: torch.Tensor, xhat: torch.Tensor,
                        rstd: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """norm_mlp_backward with the weight gradients in the same graph: (dx, dg, dW1, dW3,
    dW2)."""
    dx, dh, dgate, dup = norm_mlp_backward(dy, gate, act, up, w1, w3, w2, xhat, rstd, g)
    dg = _rows(dh.to(xhat.dtype) * xhat).sum(0).to(g.dtype)
    return (dx, dg, (_rows(dgate).t() @ _rows(h)).to(w1.dtype),
            (_rows(dup).t() @ _rows(h)).to(w3.dtype), (_rows(dy).t() @ _rows(a)).to(w2.dtype))


class QKVRopeFn(torch.autograd.Function):
    """The q, k, v projections and the rotation of q and k: one compiled kernel each
    way. Saves h and the tables, as the eager linears and rotation do."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                sink: list[WGradEntry] | None, kernels: Any):
        ctx.save_for_backward(h, wq, wk, wv, cos, sin)
        ctx.biases, ctx.sink, ctx.kernels = (bq, bk, bv), sink, kernels
        return kernels.qkv_rope_forward(h.detach(), wq.detach(), wk.detach(), wv.detach(),
                                        *(None if b is None else b.detach() for b in (bq, bk, bv)),
                                        cos, sin, head_dim)

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor):
        h, wq, wk, wv, cos, sin = ctx.saved_tensors
        dh, *dys = ctx.kernels.qkv_rope_backward(gq, gk, gv, wq, wk, wv, cos, sin)
        linears = tuple((w, b, h, dy) for w, b, dy in zip((wq, wk, wv), ctx.biases, dys,
                                                          strict=True))
        grads = weight_work(ctx.sink, ctx.needs_input_grad[1:7], linears)
        return dh, *grads, None, None, None, None, None


class AttnOutFn(torch.autograd.Function):
    """The output projection of the attention core's o [b, heads, s, hd]: one node in
    B's graph instead of the transpose, reshape and linear's several (a matmul is
    one BLAS call each way: nothing to compile). Saves the reshaped o, which the
    eager linear saves (a view of o where o's layout allows, as eagerly)."""

    @staticmethod
    def forward(ctx: Any, o: torch.Tensor, wo: torch.Tensor, sink: list[WGradEntry] | None):
        b, heads, s, _ = o.shape
        o2 = o.detach().transpose(1, 2).reshape(b, s, -1)  # [b, s, heads * hd]
        ctx.save_for_backward(o2, wo)
        ctx.sink, ctx.heads = sink, heads
        return F.linear(o2, wo.detach())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        o2, wo = ctx.saved_tensors
        b, s, _ = dy.shape
        do = (dy @ wo).view(b, s, ctx.heads, -1).transpose(1, 2)
        grads = weight_work(ctx.sink, (ctx.needs_input_grad[1], False), ((wo, None, o2, dy),))
        return do, grads[0], None


class MLPFn(torch.autograd.Function):
    """The SwiGLU MLP w2(silu(w1 h) * w3 h): one compiled kernel each way. Saves h, the
    gate, silu(gate), the up projection and w2's input, as the eager ops do."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                sink: list[WGradEntry] | None, kernels: Any):
        out, gate, act, up, a = kernels.mlp_forward(h.detach(), w1.detach(), w3.detach(),
                                                    w2.detach())
        ctx.save_for_backward(h, gate, act, up, a, w1, w3, w2)
        ctx.sink, ctx.kernels = sink, kernels
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        h, gate, act, up, a, w1, w3, w2 = ctx.saved_tensors
        dh, dgate, dup = ctx.kernels.mlp_backward(dy, gate, act, up, w1, w3, w2)
        needs = ctx.needs_input_grad
        grads = weight_work(ctx.sink, (*needs[1:4], False, False, False),
                             ((w1, None, h, dgate), (w3, None, h, dup), (w2, None, a, dy)))
        return dh, *grads[:3], None, None




class NormQKVRopeFn(torch.autograd.Function):
    """RMSNorm, the q, k, v projections and the rotation (a unit's branch at one TP
    rank, where no all-reduce sits between the norm and the projections): one
    compiled kernel each way. Saves what NormFn and QKVRopeFn save."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: torch.Tensor, eps: float, wq: torch.Tensor,
                wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor | None,
                bk: torch.Tensor | None, bv: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, head_dim: int, sink: list[WGradEntry] | None, kernels: Any):
        q, k, v, h, xhat, rstd = kernels.norm_qkv_rope_forward(
            x.detach(), g.detach(), eps, wq.detach(), wk.detach(), wv.detach(),
            *(None if b is None else b.detach() for b in (bq, bk, bv)), cos, sin, head_dim)
        ctx.save_for_backward(h, wq, wk, wv, cos, sin, xhat, rstd, g, *norm_kept_input(x, sink))
        ctx.biases, ctx.sink, ctx.kernels = (bq, bk, bv), sink, kernels
        return q, k, v

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor):
        h, wq, wk, wv, cos, sin, xhat, rstd, g = ctx.saved_tensors[:9]
        if ctx.sink is None:  # plain autograd: every gradient from one compiled graph
            dx, *grads = ctx.kernels.norm_qkv_rope_backward_w(
                gq, gk, gv, h, wq, wk, wv, cos, sin, xhat, rstd, g,
                ctx.biases[0] is not None)
            needs = (ctx.needs_input_grad[1], *ctx.needs_input_grad[3:9])  # g; weights, biases
            grads = [gr if need else None for gr, need in zip(grads, needs, strict=True)]
            return dx, grads[0], None, *grads[1:], None, None, None, None, None
        dx, dh, *dys = ctx.kernels.norm_qkv_rope_backward(gq, gk, gv, wq, wk, wv, cos, sin,
                                                          xhat, rstd, g)
        grad_g = norm_weight_work(ctx.sink, ctx.needs_input_grad[1], g, xhat, dh)
        linears = tuple((w, b, h, dy) for w, b, dy in zip((wq, wk, wv), ctx.biases, dys,
                                                          strict=True))
        grads = weight_work(ctx.sink, ctx.needs_input_grad[3:9], linears)
        return dx, grad_g, None, *grads, None, None, None, None, None


class NormMLPFn(torch.autograd.Function):
    """RMSNorm and the SwiGLU MLP (a unit's branch at one TP rank): one compiled kernel
    each way. Saves what NormFn and MLPFn save."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: torch.Tensor, eps: float, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, sink: list[WGradEntry] | None, kernels: Any):
        out, gate, act, up, a, h, xhat, rstd = kernels.norm_mlp_forward(
            x.detach(), g.detach(), eps, w1.detach(), w3.detach(), w2.detach())
        ctx.save_for_backward(h, gate, act, up, a, w1, w3, w2, xhat, rstd, g,
                              *norm_kept_input(x, sink))
        ctx.sink, ctx.kernels = sink, kernels
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        h, gate, act, up, a, w1, w3, w2, xhat, rstd, g = ctx.saved_tensors[:11]
        if ctx.sink is None:  # plain autograd: every gradient from one compiled graph
            dx, *grads = ctx.kernels.norm_mlp_backward_w(dy, h, gate, act, up, a, w1, w3, w2,
                                                         xhat, rstd, g)
            needs = ctx.needs_input_grad
            dg, dw1, dw3, dw2 = (gr if need else None for gr, need in
                                 zip(grads, (needs[1], *needs[3:6]), strict=True))
            return dx, dg, None, dw1, dw3, dw2, None, None
        dx, dh, dgate, dup = ctx.kernels.norm_mlp_backward(dy, gate, act, up, w1, w3, w2,
                                                           xhat, rstd, g)
        grad_g = norm_weight_work(ctx.sink, ctx.needs_input_grad[1], g, xhat, dh)
        grads = weight_work(ctx.sink, (*ctx.needs_input_grad[3:6], False, False, False),
                            ((w1, None, h, dgate), (w3, None, h, dup), (w2, None, a, dy)))
        return dx, grad_g, None, *grads[:3], None, None
