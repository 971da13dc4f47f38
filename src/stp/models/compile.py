"""`stp train --compile`: stp's units compiled with torch.compile (TorchInductor) in
graphs of stp's own cut, the split backward left as it is. On the CPU, at one TP
rank a stage's layers are one forward graph and one B graph per microbatch
(stp.models.compile_chunk), and with more TP ranks an attention unit's body is
one graph each way (stp.models.compile_attention); where those do not apply (a
GPU, selective recomputation, sequence parallelism) the smaller pieces below.

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
    partitioner, so the activation census (stp.costmodel.decoder.kept), `stp memory`,
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

from stp.models.compile_attention import AttentionFn, attention_backward, attention_forward
from stp.models.compile_chunk import (
    ATTN,
    MLP,
    ChunkFn,
    chunk_backward,
    chunk_backward_w,
    chunk_forward,
)
from stp.models.compile_loss import (
    LossGraphs,
    loss_backward,
    loss_backward_partial,
    loss_backward_w,
    loss_forward,
    loss_forward_partial,
)
from stp.models.compile_pieces import (
    AttnOutFn,
    MLPFn,
    NormFn,
    NormMLPFn,
    NormQKVRopeFn,
    QKVRopeFn,
    RopeFn,
    SwiGLUFn,
    mlp_backward,
    mlp_forward,
    norm_backward,
    norm_forward,
    norm_mlp_backward,
    norm_mlp_backward_w,
    norm_mlp_forward,
    norm_qkv_rope_backward,
    norm_qkv_rope_backward_w,
    norm_qkv_rope_forward,
    qkv_rope_backward,
    qkv_rope_forward,
    rope_backward,
    rope_forward,
    swiglu_backward,
    swiglu_forward,
)
from stp.models.compile_weights import entries, fusable
from stp.models.decoder.kernels import Kernels
from stp.models.tp.layers import vocab_ce_grad, vocab_ce_stats
from stp.models.tp.wgrad import GradTaps, WGradEntry
from stp.runtime.stage_api import stage_units

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


class CompiledKernels(Kernels):
    """The units' pieces between linears, compiled (see the module doc)."""

    compiled = True

    def __init__(self) -> None:
        self.norm_forward = _Compiled(norm_forward)
        self.norm_backward = _Compiled(norm_backward)
        self.rope_forward = _Compiled(rope_forward)
        self.rope_backward = _Compiled(rope_backward)
        self.swiglu_forward = _Compiled(swiglu_forward)
        self.swiglu_backward = _Compiled(swiglu_backward)
        self.qkv_rope_forward = _Compiled(qkv_rope_forward)
        self.qkv_rope_backward = _Compiled(qkv_rope_backward)
        self.mlp_forward = _Compiled(mlp_forward)
        self.mlp_backward = _Compiled(mlp_backward)
        self.norm_qkv_rope_forward = _Compiled(norm_qkv_rope_forward)
        self.norm_qkv_rope_backward = _Compiled(norm_qkv_rope_backward)
        self.norm_mlp_forward = _Compiled(norm_mlp_forward)
        self.norm_mlp_backward = _Compiled(norm_mlp_backward)
        self.norm_qkv_rope_backward_w = _Compiled(norm_qkv_rope_backward_w)
        self.norm_mlp_backward_w = _Compiled(norm_mlp_backward_w)
        self.attention_forward = _Compiled(attention_forward)
        self.attention_backward = _Compiled(attention_backward)
        self.chunk_forward = _Compiled(chunk_forward)
        self.chunk_backward = _Compiled(chunk_backward)
        self.chunk_backward_w = _Compiled(chunk_backward_w)
        self._ce_stats = _Compiled(vocab_ce_stats)
        self._ce_grad = _Compiled(vocab_ce_grad)
        for fn in (loss_forward, loss_forward_partial, loss_backward, loss_backward_w,
                   loss_backward_partial):
            setattr(self, fn.__name__, _Compiled(fn))
        self.loss_graphs = LossGraphs(self)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
             sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # no graph (full recomputation's forward, eval)
            return self.norm_forward(x, weight, eps)[0]
        # sink None: autograd's own weight gradient (a one-graph unit's full BW)
        return NormFn.apply(x, weight, eps, entries(sink), self)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return RopeFn.apply(q, k, cos, sin, self)
        return self.rope_forward(q, k, cos, sin)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return SwiGLUFn.apply(gate, up, self)
        return self.swiglu_forward(gate, up)[0]

    def qkv_rope(self, h: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                 cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                 sink: list[WGradEntry] | GradTaps | None) -> tuple[torch.Tensor, ...]:
        if not fusable(sink):
            return super().qkv_rope(h, weights, biases, cos, sin, head_dim, sink)
        if not _needs_graph(h, *weights, *biases):
            return self.qkv_rope_forward(h, *weights, *biases, cos, sin, head_dim)
        return QKVRopeFn.apply(h, *weights, *biases, cos, sin, head_dim, entries(sink), self)

    def attn_out(self, o: torch.Tensor, wo: torch.Tensor,
                 sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not fusable(sink) or not _needs_graph(o, wo):
            return super().attn_out(o, wo, sink)
        return AttnOutFn.apply(o, wo, entries(sink))

    def attention(self, h: torch.Tensor,
                  weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], wo: torch.Tensor,
                  biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                  cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                  sink: list[WGradEntry] | GradTaps | None, recompute: str,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        if (not fusable(sink) or recompute == "selective" or h.device.type != "cpu"
                or mask is not None):  # the graph's kernel is the causal one
            return super().attention(h, weights, wo, biases, cos, sin, head_dim, sink,
                                     recompute, mask)
        if not _needs_graph(h, *weights, wo, *biases):
            return self.attention_forward(h, *weights, wo, *biases, cos, sin, head_dim)[0]
        return AttentionFn.apply(h, *weights, wo, *biases, cos, sin, head_dim, entries(sink),
                                 self)

    def mlp(self, h: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            sink: list[WGradEntry] | GradTaps | None) -> torch.Tensor:
        if not fusable(sink):
            return super().mlp(h, w1, w3, w2, sink)
        if not _needs_graph(h, w1, w3, w2):
            return self.mlp_forward(h, w1, w3, w2)[0]
        return MLPFn.apply(h, w1, w3, w2, entries(sink), self)

    def norm_qkv_rope(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                      cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                      sink: GradTaps | None) -> tuple[torch.Tensor, ...]:
        if not fusable(sink):
            return super().norm_qkv_rope(x, norm_w, eps, weights, biases, cos, sin, head_dim, sink)
        if not _needs_graph(x, norm_w, *weights, *biases):
            return self.norm_qkv_rope_forward(x, norm_w, eps, *weights, *biases, cos, sin,
                                              head_dim)[:3]
        return NormQKVRopeFn.apply(x, norm_w, eps, *weights, *biases, cos, sin, head_dim,
                                   entries(sink), self)

    def norm_mlp(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float, w1: torch.Tensor,
                 w3: torch.Tensor, w2: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        if not fusable(sink):
            return super().norm_mlp(x, norm_w, eps, w1, w3, w2, sink)
        if not _needs_graph(x, norm_w, w1, w3, w2):
            return self.norm_mlp_forward(x, norm_w, eps, w1, w3, w2)[0]
        return NormMLPFn.apply(x, norm_w, eps, w1, w3, w2, entries(sink), self)

    def layers(self, parts: tuple[Any, ...], x: torch.Tensor,
               sink: GradTaps | None) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = chunk_spec(parts, x) if fusable(sink) else None
        if chunk is None:
            return super().layers(parts, x, sink)
        spec, params = chunk
        if not _needs_graph(x, *params):  # full recomputation's forward, eval: same graph
            out = self.chunk_forward(x, params, spec, False)
            return out[0], out[1]
        return ChunkFn.apply(x, spec, entries(sink), self, *params)

    def ce_stats(self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                 tp_size: int, tp_rank: int, vocab_valid: int | None) -> torch.Tensor:
        return self._ce_stats(logits, targets, vocab_start, tp_size, tp_rank, vocab_valid)

    def ce_grad(self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                vocab_start: int, grad_loss: torch.Tensor,
                vocab_valid: int | None) -> torch.Tensor:
        # one element, not 0-dim: TorchDynamo reads a 0-dim float tensor's value in its
        # guard (a NaN check: a host sync per call); the broadcast gives the same values
        return self._ce_grad(logits, targets, lse, vocab_start, grad_loss.reshape(1),
                             vocab_valid)


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
        units = stage_units(stage)
        if not units:
            raise ValueError(f"compile=True: stage {type(stage).__name__} has no stp units to "
                             "compile; a stage builder of your own compiles its own stages")
        for unit in units:
            for part in (unit, *getattr(unit, "parts", ())):
                if isinstance(getattr(part, "kernels", None), Kernels):
                    part.kernels = kernels
                    count += 1
    return count


def chunk_spec(parts: tuple[Any, ...], x: torch.Tensor) -> tuple[tuple, tuple] | None:
    """(spec, parameters) of a layer chunk's one-graph form (stp.models.compile_chunk),
    or None where the chunk keeps the pieces: a GPU (the graph names the CPU flash
    kernel), selective recomputation (it replaces the attention core), sequence
    parallelism, or a unit of another kind."""
    from stp.models.decoder.units import AttentionUnit, MLPUnit

    if x.device.type != "cpu":
        return None
    spec: list[tuple] = []
    params: list[torch.Tensor | None] = []
    for part in parts:
        if part.recompute == "selective" or part.seq is not None:
            return None
        if type(part) is AttentionUnit:
            cos, sin = part.rope.get(x.shape[1], x.device, x.dtype)
            spec.append((ATTN, part.eps, part.head_dim))
            params += [part.norm_w, part.wq, part.wk, part.wv, part.wo, part.bq, part.bk,
                       part.bv, cos, sin]
        elif type(part) is MLPUnit:
            spec.append((MLP, part.eps, 0))
            params += [part.norm_w, part.w1, part.w3, part.w2]
        else:
            return None
    return tuple(spec), tuple(params)
