"""`stp train --compile`: the pieces of a unit between its all-reduce, its attention
core and its deferred weight gradients compiled with torch.compile
(TorchInductor), the split backward left as it is.

Granularity (docs/compile.md says why): RMSNorm; the q, k, v projections with
the rotation of q and k; the whole SwiGLU MLP (w1, w3, the gate, w2); the
cross-entropy's statistics and gradient -- each as a forward kernel graph and
a backward kernel graph, called from an autograd Function of stp's own:

    h --[ norm fw* ]--> [ wq,wk,wv + rope fw* ]--> SDPA --> [ wo ] --> partial
    dh <-[ norm bw* ]-- [ dx, and dy per linear* ] <-- dSDPA <-- [ wo ] <-- dy
                          \\______ W: (x, dy) of every linear, recorded _____/
    (* compiled: an inference graph each, no autograd inside; the matmuls are
       inductor's calls of the same BLAS kernels)

So the things stp's runtime relies on are untouched:
  - B computes input gradients and each linear's output gradient only, and
    records (x, dy) per linear in the unit's sink, as the eager linears'
    gradient edges do (stp.models.tp.wgrad); W multiplies them where the
    schedule puts it. A backward without a sink (a plain-autograd full BW at
    one TP rank) returns the weight gradients instead;
  - a unit is still a unit: braiding launches each TP all-reduce between units;
  - each Function saves exactly the tensors the eager ops save (the norm's
    float32 xhat and rstd, the linears' inputs, the gate's input, silu output
    and up projection), chosen by stp, not by AOTAutograd's min-cut
    partitioner, so the activation census (stp.costmodel.kept), `stp memory`,
    offload (which reads the saved tensors of every node) and recomputation
    (which reruns the same Functions) see what they see eagerly;
  - the attention core stays F.scaled_dot_product_attention (a fused kernel
    already), so selective recomputation is unchanged; under sequence
    parallelism the linears stay eager (each routes its gathered input).

Shapes are static per run (dynamic=False): each kernel compiles once per shape
and dtype a run uses, and every kernel is called with gradients off so grad
mode never forces a second graph. Compile seconds are counted process-wide
(`compile_stats`) so a run can report them apart from its step times.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stp.models.decoder.kernels import Kernels
from stp.models.decoder.rope import apply_rope
from stp.models.tp.layers import vocab_ce_grad, vocab_ce_stats
from stp.models.tp.wgrad import GradTaps, LinearGrad, NormGrad, WGradEntry

__all__ = ["CompileStats", "CompiledKernels", "compile_stats", "compile_stages",
           "compiled_kernels"]


@dataclass
class CompileStats:
    """Graphs compiled in this process and the seconds the calls that compiled took
    (tracing, inductor and the C++ build, or loading them from inductor's cache)."""

    graphs: int = 0
    seconds: float = 0.0


_STATS = CompileStats()


def compile_stats() -> CompileStats:
    """This process's compile counts so far (a copy)."""
    return CompileStats(_STATS.graphs, _STATS.seconds)


class _Compiled:
    """torch.compile(fn) called with gradients off (one graph per shape, never one per
    grad mode), timing the calls that compiled a graph (TorchDynamo's graph counter
    moved). Kept lean: it runs a few hundred times a step."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        from torch._dynamo.utils import counters

        self._fn = torch.compile(fn, dynamic=False, fullgraph=True)
        self._counters = counters  # its "stats" Counter may be cleared and made anew

    def __call__(self, *args: Any) -> Any:
        before = self._counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        if torch.is_grad_enabled():  # an autograd Function's passes run with it off already
            with torch.no_grad():
                out = self._fn(*args)
        else:
            out = self._fn(*args)
        after = self._counters["stats"]["unique_graphs"]
        if after != before:
            _STATS.graphs += after - before
            _STATS.seconds += time.perf_counter() - start
        return out


# The kernels: the eager maths of stp.models.tp.layers and stp.models.decoder.rope,
# split into forward and backward functions without autograd.

def _norm_forward(x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    return (xhat * weight).to(x.dtype), xhat, rstd


def _norm_backward(grad_out: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
    dxhat = grad_out.to(xhat.dtype) * weight
    grad_x = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return grad_x.to(grad_out.dtype)


def _rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _unrotate(u: torch.Tensor) -> torch.Tensor:
    """The transpose of rotate_half (x1, x2 -> -x2, x1): u1, u2 -> u2, -u1."""
    u1, u2 = u.chunk(2, dim=-1)
    return torch.cat([u2, -u1], dim=-1)


def _rope_backward(gq: torch.Tensor, gk: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gq * cos + _unrotate(gq * sin), gk * cos + _unrotate(gk * sin)


def _swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    act = F.silu(gate)
    return act * up, act


def _swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, act: torch.Tensor,
                     up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sig = torch.sigmoid(gate)  # silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
    return grad * up * (sig * (1 + gate * (1 - sig))), grad * act


class _NormFn(torch.autograd.Function):
    """stp.models.tp.layers._RMSNormFn with compiled kernels: saves xhat and rstd, defers
    the gain's gradient to the sink. Without a sink (a full BW in plain autograd) it
    returns the gain's gradient instead, and also keeps the input in the statistics'
    dtype, as the eager ops do then (x itself in float32 and float64), so the bytes
    kept stay eager's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                sink: list[WGradEntry] | None, kernels: CompiledKernels):
        y, xhat, rstd = kernels.norm_forward(x.detach(), weight.detach(), eps)
        if sink is None:
            ctx.save_for_backward(xhat, rstd, weight,
                                  x.detach().to(torch.promote_types(x.dtype, torch.float32)))
        else:
            ctx.save_for_backward(xhat, rstd, weight)
        ctx.sink, ctx.kernels = sink, kernels
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors[:3]
        grad_w = None
        if ctx.sink is not None:
            ctx.sink.append(NormGrad(weight, xhat, grad_out))
        elif ctx.needs_input_grad[1]:
            h = xhat.shape[-1]
            grad_w = (grad_out.to(xhat.dtype) * xhat).reshape(-1, h).sum(0).to(weight.dtype)
        grad_x = ctx.kernels.norm_backward(grad_out, xhat, rstd, weight.detach())
        return grad_x, grad_w, None, None, None


class _RopeFn(torch.autograd.Function):
    """Rotary embedding of q and k in one kernel each way; saves the tables only, as the
    eager multiplications do."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kernels: CompiledKernels):
        ctx.save_for_backward(cos, sin)
        ctx.kernels = kernels
        return kernels.rope_forward(q.detach(), k.detach(), cos, sin)

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return (*ctx.kernels.rope_backward(gq, gk, cos, sin), None, None, None)


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up in one kernel; saves gate, silu(gate) and up, as the eager ops do."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kernels: CompiledKernels):
        gate, up = gate.detach(), up.detach()
        out, act = kernels.swiglu_forward(gate, up)
        ctx.save_for_backward(gate, act, up)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        gate, act, up = ctx.saved_tensors
        return (*ctx.kernels.swiglu_backward(grad, gate, act, up), None)


def _qkv_rope_forward(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                      bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                      cos: torch.Tensor, sin: torch.Tensor,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, s, _ = h.shape
    q, k, v = (F.linear(h, w, bias).view(b, s, -1, head_dim).transpose(1, 2)
               for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _qkv_rope_backward(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, wq: torch.Tensor,
                       wk: torch.Tensor, wv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dh, and the output gradients of the q, k, v projections [b, s, heads * hd])."""
    gq, gk = gq * cos + _unrotate(gq * sin), gk * cos + _unrotate(gk * sin)
    b, _, s, _ = gq.shape
    dq, dk, dv = (g.transpose(1, 2).reshape(b, s, -1) for g in (gq, gk, gv))
    return dq @ wq + dk @ wk + dv @ wv, dq, dk, dv


def _mlp_forward(h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(out, and what B needs: the gate, silu(gate), the up projection, w2's input)."""
    gate, up = F.linear(h, w1), F.linear(h, w3)
    act = F.silu(gate)
    a = act * up
    return F.linear(a, w2), gate, act, up, a


def _mlp_backward(dy: torch.Tensor, gate: torch.Tensor, act: torch.Tensor, up: torch.Tensor,
                  w1: torch.Tensor, w3: torch.Tensor,
                  w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, and the output gradients of w1 and w3)."""
    dgate, dup = _swiglu_backward(dy @ w2, gate, act, up)
    return dgate @ w1 + dup @ w3, dgate, dup


def _weight_work(sink: list[WGradEntry] | None, needs: tuple[bool, ...],
                 linears: tuple[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                      torch.Tensor], ...]) -> tuple[torch.Tensor | None, ...]:
    """The weight side of a fused piece's B, per linear (weight, bias, input x, output
    gradient dy): with a sink, W's records (LinearGrad, exactly what the taps or the
    deferring Functions record), and no gradient returned; without one (a full BW in
    plain autograd), the gradients themselves, weights then biases, as the
    Function's backward returns them (`needs`: ctx.needs_input_grad of those)."""
    if sink is not None:
        sink.extend(LinearGrad(w, x, dy, bias) for w, bias, x, dy in linears)
        return (None,) * (2 * len(linears))
    grads: list[torch.Tensor | None] = []
    for w, _, x, dy in linears:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        grads.append((dy2.t() @ x2).to(w.dtype))
    for _, bias, _, dy in linears:
        grads.append(None if bias is None else dy.reshape(-1, dy.shape[-1]).sum(0))
    return tuple(g if need else None for g, need in zip(grads, needs, strict=True))


def _entries(sink: list[WGradEntry] | GradTaps | None) -> list[WGradEntry] | None:
    return sink.sink if isinstance(sink, GradTaps) else sink


def _fusable(sink: Any) -> bool:
    """A sink a fused piece can serve: taps, a list, or none (plain autograd). Sequence
    parallelism's RegatheredInput routes each linear itself: the pieces one by one."""
    return sink is None or isinstance(sink, (GradTaps, list))


class _QKVRopeFn(torch.autograd.Function):
    """The q, k, v projections and the rotation of q and k: one compiled kernel each
    way. Saves h and the tables, as the eager linears and rotation do."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                sink: list[WGradEntry] | None, kernels: CompiledKernels):
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
        grads = _weight_work(ctx.sink, ctx.needs_input_grad[1:7], linears)
        return dh, *grads, None, None, None, None, None


class _AttnOutFn(torch.autograd.Function):
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
        grads = _weight_work(ctx.sink, (ctx.needs_input_grad[1], False), ((wo, None, o2, dy),))
        return do, grads[0], None


class _MLPFn(torch.autograd.Function):
    """The SwiGLU MLP w2(silu(w1 h) * w3 h): one compiled kernel each way. Saves h, the
    gate, silu(gate), the up projection and w2's input, as the eager ops do."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                sink: list[WGradEntry] | None, kernels: CompiledKernels):
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
        grads = _weight_work(ctx.sink, (*needs[1:4], False, False, False),
                             ((w1, None, h, dgate), (w3, None, h, dup), (w2, None, a, dy)))
        return dh, *grads[:3], None, None


class CompiledKernels(Kernels):
    """The units' pieces between linears, compiled (see the module doc)."""

    compiled = True

    def __init__(self) -> None:
        self.norm_forward = _Compiled(_norm_forward)
        self.norm_backward = _Compiled(_norm_backward)
        self.rope_forward = _Compiled(_rope_forward)
        self.rope_backward = _Compiled(_rope_backward)
        self.swiglu_forward = _Compiled(_swiglu_forward)
        self.swiglu_backward = _Compiled(_swiglu_backward)
        self.qkv_rope_forward = _Compiled(_qkv_rope_forward)
        self.qkv_rope_backward = _Compiled(_qkv_rope_backward)
        self.mlp_forward = _Compiled(_mlp_forward)
        self.mlp_backward = _Compiled(_mlp_backward)
        self._ce_stats = _Compiled(vocab_ce_stats)
        self._ce_grad = _Compiled(vocab_ce_grad)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
             sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # no graph (full recomputation's forward, eval)
            return self.norm_forward(x, weight, eps)[0]
        # sink None: autograd's own weight gradient (a one-graph unit's full BW)
        return _NormFn.apply(x, weight, eps, _entries(sink), self)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return _RopeFn.apply(q, k, cos, sin, self)
        return self.rope_forward(q, k, cos, sin)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _SwiGLUFn.apply(gate, up, self)
        return self.swiglu_forward(gate, up)[0]

    def qkv_rope(self, h: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                 cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                 sink: list[WGradEntry] | GradTaps | None) -> tuple[torch.Tensor, ...]:
        if not _fusable(sink):
            return super().qkv_rope(h, weights, biases, cos, sin, head_dim, sink)
        if not _needs_graph(h, *weights, *biases):
            return self.qkv_rope_forward(h, *weights, *biases, cos, sin, head_dim)
        return _QKVRopeFn.apply(h, *weights, *biases, cos, sin, head_dim, _entries(sink), self)

    def attn_out(self, o: torch.Tensor, wo: torch.Tensor,
                 sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not _fusable(sink) or not _needs_graph(o, wo):
            return super().attn_out(o, wo, sink)
        return _AttnOutFn.apply(o, wo, _entries(sink))

    def mlp(self, h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not _fusable(sink):
            return super().mlp(h, w1, w3, w2, sink)
        if not _needs_graph(h, w1, w3, w2):
            return self.mlp_forward(h, w1, w3, w2)[0]
        return _MLPFn.apply(h, w1, w3, w2, _entries(sink), self)

    def ce_stats(self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                 tp_size: int, tp_rank: int, vocab_valid: int | None) -> torch.Tensor:
        return self._ce_stats(logits, targets, vocab_start, tp_size, tp_rank, vocab_valid)

    def ce_grad(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                vocab_start: int, grad_loss: torch.Tensor,
                vocab_valid: int | None) -> torch.Tensor:
        return self._ce_grad(logits, targets, lse, vocab_start, grad_loss, vocab_valid)


def _needs_graph(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.cache
def compiled_kernels() -> CompiledKernels:
    """One set per process: every stage and unit shares torch.compile's cache."""
    return CompiledKernels()


def compile_stages(stages: Mapping[int, Any] | Iterable[Any]) -> int:
    """Give every unit of these stages that has kernels (stp.models.decoder.kernels) the
    compiled ones; returns how many took them (units without any, e.g. the embedding
    or a vision encoder's, stay eager). ValueError (one line) for a stage without
    units (a stage builder of the user's own: it compiles itself)."""
    kernels, count = compiled_kernels(), 0
    for stage in (stages.values() if isinstance(stages, Mapping) else stages):
        units = getattr(stage, "units", None)
        if units is None:
            raise ValueError(f"compile=True: stage {type(stage).__name__} has no stp units to "
                             "compile; a stage builder of your own compiles its own stages")
        for unit in units:
            for part in (unit, *getattr(unit, "parts", ())):
                if isinstance(getattr(part, "kernels", None), Kernels):
                    part.kernels = kernels
                    count += 1
    return count
