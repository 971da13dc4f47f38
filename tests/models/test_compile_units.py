"""`compile` unit by unit, in one process (stp.models.compile): a stage whose units run
compiled kernels gives the float64 losses and weight gradients of the eager
stage within 1e-10, keeps exactly the bytes the eager stage keeps from F to B
(stp's saved tensors, not inductor's choice), and still defers W: after B no
weight has a gradient, after W every one has. A second pass over the same
shapes compiles nothing more. One compiled stage per layout serves the
module's tests (torch.compile's cache is per process)."""

from __future__ import annotations

import functools

import pytest
import torch

from stp.models import ModelConfig, StagePlacement
from stp.models.compile import compile_stages, compile_stats
from stp.models.decoder.stage import build_stage
from stp.runtime.graph_saved import graph_saved

CONFIG = ModelConfig(vocab_size=32, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     ffn_hidden=64, max_seq_len=16, seed=3, qkv_bias=True)
SAME = 1e-10


def _inputs():
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(2)]
    return tokens, targets


def _kept_bytes(stage, mb: int) -> int:
    """Bytes microbatch mb keeps from F to B, as the offloader counts them (the units'
    tensors and their graphs' saved tensors, parameters and rotary tables left out)."""
    shared = {t.untyped_storage().data_ptr()
              for t in (*stage.parameters(), *stage.shared_tensors())}
    kept = stage.kept_tensors(mb)
    tensors = [*kept, *graph_saved([t for t in kept if t.grad_fn is not None])]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in shared)


def _split_backward(stage, recompute: str = "none", at_once: bool = False) -> dict:
    """F of two microbatches, then B of each with W after both Bs; what was seen.
    at_once: both backwards are full BWs (plain autograd computes the weight
    gradients in B's walk, kept until W adds them)."""
    tokens, targets = _inputs()
    stage.weights_in_backward((0, 1) if at_once else ())
    losses = [stage.forward(mb, x, t) for mb, (x, t) in enumerate(zip(tokens, targets,
                                                                      strict=True))]
    kept = _kept_bytes(stage, 0)
    for mb in (0, 1):
        stage.backward_input(mb, None, 0.5)
    before_w = {n: p.grad for n, p in stage.named_parameters()}
    for mb in (0, 1):
        stage.backward_weight(mb)
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad()
    return {"losses": losses, "kept": kept, "before_w": before_w, "grads": grads}


@functools.cache
def _stages(fuse: bool, recompute: str) -> tuple:
    """(eager stage, compiled stage) of the same weights."""
    eager, compiled = (build_stage(CONFIG, StagePlacement(0, 1, dtype=torch.float64,
                                                          recompute=recompute), fuse_layers=fuse)
                       for _ in range(2))
    assert compile_stages([compiled]) > 0
    return eager, compiled


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("fuse, recompute", [(True, "none"), (False, "none"), (False, "full")],
                         ids=["one-unit", "units", "units-full"])
def test_compiled_stage_equals_eager_keeps_its_bytes_and_defers_w(fuse: bool,
                                                                  recompute: str) -> None:
    eager, compiled = _stages(fuse, recompute)
    want, got = _split_backward(eager), _split_backward(compiled)
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert _rel(a, b) <= SAME
    assert got["grads"].keys() == want["grads"].keys()
    worst = max(_rel(got["grads"][n], want["grads"][n]) for n in want["grads"])
    assert worst <= SAME, worst
    # W still runs where the schedule puts it: B left every weight without a gradient
    assert all(g is None for g in got["before_w"].values()), [
        n for n, g in got["before_w"].items() if g is not None]
    assert got["kept"] == want["kept"]  # the tensors stp chose to keep, not inductor's
    # the same shapes again compile nothing
    graphs = compile_stats().graphs
    _split_backward(compiled)
    assert compile_stats().graphs == graphs


def test_a_full_backward_in_plain_autograd_equals_eager_and_keeps_its_bytes() -> None:
    # one TP rank, every backward a full BW (1F1B, GPipe): the fused pieces hand the
    # weight gradients to autograd instead of recording (x, dy) for W
    eager, compiled = _stages(True, "none")
    want, got = (_split_backward(s, at_once=True) for s in (eager, compiled))
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert _rel(a, b) <= SAME
    worst = max(_rel(got["grads"][n], want["grads"][n]) for n in want["grads"])
    assert worst <= SAME, worst
    assert got["kept"] == want["kept"]


def _graph_nodes(stage, mb: int) -> set[str]:
    seen, todo, names = set(), [t.grad_fn for t in stage.kept_tensors(mb)], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [n for n, _ in node.next_functions]
    return names


def test_compiled_units_really_run_compiled_kernels() -> None:
    _, compiled = _stages(False, "none")
    tokens, targets = _inputs()
    compiled.forward(0, tokens[0], targets[0])
    # an attention unit's body (projections, rotation, attention core, output
    # projection) and the whole MLP are one piece each (one node in B's graph, not
    # one per op)
    nodes = _graph_nodes(compiled, 0)
    assert {"AttentionFnBackward", "MLPFnBackward", "NormFnBackward"} <= nodes, nodes
    assert not {"QKVRopeFnBackward", "AttnOutFnBackward",
                "ScaledDotProductFlashAttentionForCpuBackward0"} & nodes, nodes
    compiled.backward_input(0, None, 0.5)
    compiled.backward_weight(0)
    compiled.zero_grad()
    # at one TP rank the stage's layers are one compiled graph each way: one node in
    # B's graph, the attention core inside it
    _, chunk = _stages(True, "none")
    chunk.forward(0, tokens[0], targets[0])
    nodes = _graph_nodes(chunk, 0)
    assert "ChunkFnBackward" in nodes, nodes
    pieces = {"NormQKVRopeFnBackward", "AttnOutFnBackward", "NormMLPFnBackward",
              "ScaledDotProductFlashAttentionForCpuBackward0"}
    assert not pieces & nodes, nodes
    chunk.backward_input(0, None, 0.5)
    chunk.backward_weight(0)
    chunk.zero_grad()
    _split_backward(compiled)
    kinds = {type(u).__name__: getattr(u, "kernels", None) for u in compiled.units}
    assert kinds["EmbedUnit"] is None  # a lookup: nothing between linears to compile
    assert all(k is not None and k.compiled for name, k in kinds.items() if name != "EmbedUnit")
    assert compile_stats().graphs >= 8  # norm, rotary, SwiGLU and loss, each way


def test_a_stage_without_units_and_a_non_bool_are_refused_in_one_line() -> None:
    from stp.train.step.trainer import TrainerOptions

    with pytest.raises(ValueError, match=r"^compile=True: stage object has no stp units"):
        compile_stages([object()])
    with pytest.raises(ValueError, match=r"^compile must be True or False, got 'yes'$"):
        TrainerOptions(compile="yes")


def test_the_compiled_loss_gradient_reads_no_tensor_on_the_host(monkeypatch) -> None:
    # the loss gradient arrives as a 0-dim float tensor; TorchDynamo guards such a
    # tensor by value (an .item() per call, a device sync on a GPU) unless the
    # compiled kernel gets it as one element
    from stp.models.compile import compiled_kernels

    kernels = compiled_kernels()
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 8, 32, generator=gen)
    targets = torch.randint(0, 32, (2, 8), generator=gen)
    lse = torch.logsumexp(logits, -1)
    want = kernels.ce_grad(logits, targets, lse, 0, torch.tensor(0.5, dtype=torch.float64), 32)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    got = kernels.ce_grad(logits, targets, lse, 0, torch.tensor(0.5, dtype=torch.float64), 32)
    assert reads == []
    assert torch.equal(got, want) and got.shape == logits.shape


def test_the_compiled_loss_unit_is_one_graph_each_way(monkeypatch) -> None:
    # the final norm, head and cross-entropy: one compiled call in F (the finish in
    # it), one in B, no autograd graph kept; W still waits (its records)
    from stp.models.compile import compiled_kernels

    _, chunk = _stages(True, "none")
    kernels, calls = compiled_kernels(), []
    for name in ("loss_forward", "loss_backward", "loss_backward_w", "_ce_stats", "_ce_grad",
                 "norm_forward", "norm_backward"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, fn=fn, name=name: calls.append(name)
                            or fn(*a))
    tokens, targets = _inputs()
    chunk.weights_in_backward(())
    chunk.forward(0, tokens[0], targets[0])
    loss_unit = chunk.units[-1]
    assert type(loss_unit).__name__ == "LossUnit"
    assert calls == ["loss_forward"]
    assert all(t.grad_fn is None for t in loss_unit.kept_tensors(0))
    chunk.backward_input(0, None, 0.5)
    assert calls == ["loss_forward", "loss_backward"]
    assert loss_unit.head_w.grad is None  # W's work waits in the records
    chunk.backward_weight(0)
    assert loss_unit.head_w.grad is not None and loss_unit.norm_w.grad is not None
    chunk.zero_grad()


def _matmuls(fn, *args) -> tuple[int, tuple]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn(*args)
    return Count.n, out


def test_shared_input_matrices_are_one_matmul_on_the_cpu() -> None:
    # q, k, v and gate, up each as one matmul each way in the compiled graphs' maths,
    # the values those of the separate matrices (float64, within the parity bound)
    from stp.models import compile_pieces as cp

    gen = torch.Generator().manual_seed(2)
    r = functools.partial(torch.randn, generator=gen, dtype=torch.float64)
    h, wq, wk, wv, bq, bk, bv = r(2, 8, 32), r(32, 32), r(16, 32), r(16, 32), r(32), r(16), r(16)
    cos, sin = r(8, 8), r(8, 8)
    n, (q, k, v) = _matmuls(cp.qkv_rope_forward, h, wq, wk, wv, bq, bk, bv, cos, sin, 8)
    assert n == 1
    want_v = torch.nn.functional.linear(h, wv, bv).view(2, 8, -1, 8).transpose(1, 2)
    assert _rel(v, want_v) <= 1e-14 and v.untyped_storage().nbytes() == want_v.numel() * 8
    gq, gk, gv = r(*q.shape), r(*k.shape), r(*v.shape)
    n, (dh, dq, dk, dv) = _matmuls(cp.qkv_rope_backward, gq, gk, gv, wq, wk, wv, cos, sin)
    assert n == 1 and _rel(dh, dq @ wq + dk @ wk + dv @ wv) <= 1e-14
    w1, w3, w2 = r(64, 32), r(64, 32), r(32, 64)
    n, (out, gate, act, up, a) = _matmuls(cp.mlp_forward, h, w1, w3, w2)
    assert n == 2 and _rel(up, h @ w3.t()) <= 1e-14
    assert up.untyped_storage().nbytes() == up.numel() * 8  # B keeps up's bytes alone
    n, (dh, dgate, dup) = _matmuls(cp.mlp_backward, r(2, 8, 32), gate, act, up, w1, w3, w2)
    assert n == 2 and _rel(dh, dgate @ w1 + dup @ w3) <= 1e-14
