"""`stp train --compile`: the pieces of a unit between its linears compiled with
torch.compile (TorchInductor), the split backward left as it is.

Granularity (docs/compile.md says why): what gets compiled is the code between
the linears of a unit -- RMSNorm, the rotary embedding of q and k, the SwiGLU
gate, the cross-entropy's statistics and gradient -- each as a forward kernel
and a backward kernel, called from an autograd Function of stp's own:

    h --[ norm fw* ]--> linear --[ rope fw* ]--> SDPA --> linear --> partial
    dh <-[ norm bw* ]-- dx <----[ rope bw* ]---- dSDPA <-- dx <----- dy
                          \\______ W: (x, dy) of every linear, eager ______/
    (* compiled: an inference graph each, no autograd inside)

So the things stp's runtime relies on are untouched:
  - the linears stay eager F.linear (or the deferring Functions): B catches
    their output gradients through gradient edges and W multiplies (x, dy)
    where the schedule puts it (stp.models.tp.wgrad);
  - a unit is still a unit: braiding launches each TP all-reduce between units;
  - each Function saves exactly the tensors the eager ops save (the norm's
    float32 xhat and rstd, the gate's input, silu output and up projection),
    chosen by stp, not by AOTAutograd's min-cut partitioner, so the activation
    census (stp.costmodel.kept), `stp memory`, offload (which reads the saved
    tensors of every node) and recomputation (which reruns the same Functions)
    see what they see eagerly;
  - the attention core stays F.scaled_dot_product_attention (a fused kernel
    already), so selective recomputation is unchanged.

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
from stp.models.tp.layers import rms_norm, vocab_ce_grad, vocab_ce_stats
from stp.models.tp.wgrad import GradTaps, NormGrad, WGradEntry

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
    the gain's gradient to the sink."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                sink: list[WGradEntry], kernels: CompiledKernels):
        y, xhat, rstd = kernels.norm_forward(x.detach(), weight.detach(), eps)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.sink, ctx.kernels = sink, kernels
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors
        ctx.sink.append(NormGrad(weight, xhat, grad_out))
        grad_x = ctx.kernels.norm_backward(grad_out, xhat, rstd, weight.detach())
        return grad_x, None, None, None, None


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
        self._ce_stats = _Compiled(vocab_ce_stats)
        self._ce_grad = _Compiled(vocab_ce_grad)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
             sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # no graph (full recomputation's forward, eval)
            return self.norm_forward(x, weight, eps)[0]
        if sink is None:
            # autograd's own weight gradient (a one-graph unit's full BW): the eager ops,
            # so what they keep for it stays what the census counts
            return rms_norm(x, weight, eps, None)
        return _NormFn.apply(x, weight, eps, sink.sink if isinstance(sink, GradTaps) else sink,
                             self)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return _RopeFn.apply(q, k, cos, sin, self)
        return self.rope_forward(q, k, cos, sin)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _SwiGLUFn.apply(gate, up, self)
        return self.swiglu_forward(gate, up)[0]

    def ce_stats(self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                 tp_size: int, tp_rank: int, vocab_valid: int | None) -> torch.Tensor:
        return self._ce_stats(logits, targets, vocab_start, tp_size, tp_rank, vocab_valid)

    def ce_grad(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                vocab_start: int, grad_loss: torch.Tensor,
                vocab_valid: int | None) -> torch.Tensor:
        return self._ce_grad(logits, targets, lse, vocab_start, grad_loss, vocab_valid)


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
