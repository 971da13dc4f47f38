"""stp.models.tp in one process, against plain autograd and hand-made collectives.

Written to kill mutants mutmut left alive in stp/models/tp/ (docs/testing.md):
the sequence-parallel collectives ran only in spawned ranks, where mutmut cannot
see which test reaches which function. Here the TP ranks are simulated: a fake
process group takes every simulated rank's call and completes the collective
once the last rank has called, as a real one does; the reference is the sum /
concatenation written out by hand. Each test names the bug it guards against.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stp.models.tp import comm, sequence
from stp.models.tp.layers import (
    linear,
    rms_norm,
    valid_token_ratio,
    vocab_ce_finish,
    vocab_ce_grad,
    vocab_ce_stats,
)
from stp.models.tp.sequence import (
    RegatheredInput,
    RegatheredLinearGrad,
    SequenceParallel,
    ToScatter,
    check_sequence,
)
from stp.models.tp.wgrad import (
    EmbedGrad,
    GradTaps,
    LinearGrad,
    ReadyGrad,
    WGradStore,
    accumulate_grad,
)
from stp.shapes.decoder import IGNORE_INDEX

D = torch.float64


class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


class _Ranks:
    """A process group shared by `size` simulated ranks that call it in rank order; the
    collective completes (every rank's output is written) at the last rank's call."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.opts: list[object] = []

    def _reduce_scatter_base(self, out, blocks, opts):  # noqa: ANN001
        self.opts.append(opts)
        self.calls.append((out, blocks.clone()))
        if len(self.calls) == self.size:
            total = sum(b for _, b in self.calls)
            for r, (o, _) in enumerate(self.calls):
                o.copy_(total.chunk(self.size)[r])  # the process group splits dim 0
        return _Work()

    def _allgather_base(self, blocks, local, opts):  # noqa: ANN001
        self.opts.append(opts)
        self.calls.append((blocks, local.clone()))
        if len(self.calls) == self.size:
            gathered = torch.cat([loc for _, loc in self.calls])  # rank-major on dim 0
            for b, _ in self.calls:
                b.copy_(gathered)
        return _Work()


def _sequences(size: int) -> tuple[_Ranks, list[SequenceParallel]]:
    group = _Ranks(size)
    return group, [SequenceParallel(group, size, r) for r in range(size)]  # type: ignore[arg-type]


def test_reduce_scatter_gives_each_rank_its_rows_of_the_sum() -> None:
    """Kills: the sequence blocks not moved to dim 0 before the scatter (with two
    sequences per batch a rank gets another sequence's rows), a wrong block size,
    an output of the wrong shape, the op not SUM or not async. Reference: the sum of
    the partials, rows [r s/t, (r+1) s/t) of it."""
    t, b, s, h = 3, 2, 6, 4
    gen = torch.Generator().manual_seed(1)
    partials = [torch.randn(b, s, h, dtype=D, generator=gen) for _ in range(t)]
    group, seqs = _sequences(t)
    outs = [seq.launch_scatter(p)[0] for seq, p in zip(seqs[:-1], partials, strict=False)]
    outs.append(seqs[-1].scatter(partials[-1]))
    total = sum(partials)
    for r, out in enumerate(outs):
        assert out.shape == (b, s // t, h)
        assert torch.equal(out, total[:, r * 2: r * 2 + 2])
        assert torch.equal(out, seqs[r].rows(total))
    assert all(o.reduceOp == dist.ReduceOp.SUM and o.asyncOp for o in group.opts)
    assert ToScatter(total).collective == "RS"


def test_all_gather_puts_every_ranks_rows_back_in_sequence_order() -> None:
    """Kills: the gathered blocks read batch-major (two sequences per batch get
    interleaved rows), a wrong full length, a non-async launch. Reference: the
    ranks' rows concatenated along the sequence."""
    t, b, part, h = 2, 3, 2, 5
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(b, part, h, dtype=D, generator=gen) for _ in range(t)]
    group, seqs = _sequences(t)
    pending = seqs[0].launch_gather(rows[0])
    full_last = seqs[1].gather(rows[1])
    full_first = pending.wait()
    expected = torch.cat(rows, dim=1)
    assert torch.equal(full_first, expected) and torch.equal(full_last, expected)
    assert all(o.asyncOp for o in group.opts)
    for r, seq in enumerate(seqs):
        assert torch.equal(seq.rows(expected), rows[r])


class _Clock:
    """perf_counter that reads 1, 2, 3, ... (one tick a call)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_a_gathers_timing_is_launch_done_and_its_compute_stream_seconds(monkeypatch) -> None:
    """Kills: the launch time or the wait left out of the exposed seconds (or
    subtracted), start and done swapped, take_gathers not emptying the list, and the
    4096 bound changed or inverted. A fake clock makes the times exact."""
    monkeypatch.setattr(sequence, "time", _Clock())
    _, seqs = _sequences(2)
    seq = seqs[1]
    seq.group = SimpleNamespace(_allgather_base=lambda blocks, local, opts: _Work())
    seq.gather(torch.zeros(1, 1, 1))
    # launch: start 1, launch_s 2 - 1; wait: t0 3, 4 - 3; _timed: done 5
    assert seq.take_gathers() == [(1.0, 5.0, 2.0)]
    assert seq.take_gathers() == []
    seq.gathers = [(0.0, 0.0, 0.0)] * 4095
    seq.gather(torch.zeros(1, 1, 1))
    assert len(seq.gathers) == 4096
    seq.gather(torch.zeros(1, 1, 1))
    assert len(seq.gathers) == 4096


def test_sequence_parallelism_refuses_one_rank_and_an_uneven_split() -> None:
    """Kills: tp 1 accepted (`< 2` changed), a divisible length refused or an
    indivisible one accepted, and the message losing the values it names."""
    with pytest.raises(ValueError, match="needs tp >= 2, got 1"):
        SequenceParallel(None, 1, 0)
    SequenceParallel(None, 2, 1)
    check_sequence(8, 4)
    check_sequence(4, 4)
    with pytest.raises(ValueError) as err:
        check_sequence(10, 4)
    assert str(err.value) == ("--sequence-parallel splits the sequence over the TP ranks: "
                              "--seq-len 10 is not divisible by tp=4 (stp refuses "
                              "rather than pads)")


def _world_is(monkeypatch, module, world: object) -> None:  # noqa: ANN001
    """`module`'s torch.distributed with `world` as the default group (no process group
    is initialised in this process)."""
    fake = SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    fake.group = SimpleNamespace(WORLD=world)
    monkeypatch.setattr(module, "dist", fake)


def test_the_default_group_is_the_world(monkeypatch) -> None:
    """Kills: `group if group is not None else WORLD` inverted (a None group used)."""
    world = _Ranks(2)
    _world_is(monkeypatch, sequence, world)
    seq = SequenceParallel(None, 2, 0)
    seq.launch_scatter(torch.zeros(1, 2, 1))
    assert len(world.calls) == 1
    mine = _Ranks(2)
    SequenceParallel(mine, 2, 0).launch_scatter(torch.zeros(1, 2, 1))  # type: ignore[arg-type]
    assert len(mine.calls) == 1 and len(world.calls) == 1


class _OneGather:
    """A SequenceParallel stand-in whose gather returns a known full input."""

    def __init__(self, full: torch.Tensor, rows: torch.Tensor) -> None:
        self.full, self.rows, self.calls = full, rows, 0

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert rows is self.rows
        return self.full


def test_a_regathered_linear_keeps_only_the_rows_and_gathers_once_in_w() -> None:
    """Kills: the record holding the full input instead of the rows, W not gathering
    (the rows used as the input), a gather per matrix instead of one per unit, the
    bias gradient dropped, the bias left out of (or subtracted from) either forward,
    a linear on another input routed to the regather, a gather of anything but the
    rows, and the input gradient changed. Reference: F.linear under plain autograd."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 4, 3, dtype=D, generator=gen, requires_grad=True)
    rows = full.detach()[:, :2]
    w1 = torch.nn.Parameter(torch.randn(5, 3, dtype=D, generator=gen))
    w2 = torch.nn.Parameter(torch.randn(5, 3, dtype=D, generator=gen))
    bias = torch.nn.Parameter(torch.randn(5, dtype=D, generator=gen))
    other = torch.randn(2, 4, 3, dtype=D, generator=gen, requires_grad=True)
    sink: list = []
    seq = _OneGather(full.detach(), rows)
    source = RegatheredInput(seq, rows, full, sink)  # type: ignore[arg-type]
    y = (linear(full, w1, source, bias) + linear(full, w2, source)
         + linear(other, w2, source, bias))
    dy = torch.randn(2, 4, 5, dtype=D, generator=gen)
    dx, dother = torch.autograd.grad(y, (full, other), dy)
    kinds = sorted(type(e).__name__ for e in sink)
    assert kinds == ["LinearGrad", "RegatheredLinearGrad", "RegatheredLinearGrad"]
    assert all(e.x is rows for e in sink if isinstance(e, RegatheredLinearGrad))
    for e in sink:
        e.accumulate()
    assert seq.calls == 1

    ref = [t.detach().clone().requires_grad_(True) for t in (full, w1, w2, bias, other)]
    ref_y = (F.linear(ref[0], ref[1], ref[3]) + F.linear(ref[0], ref[2])
             + F.linear(ref[4], ref[2], ref[3]))
    ref_y.backward(dy)
    assert torch.allclose(y, ref_y)
    assert torch.allclose(dx, ref[0].grad) and torch.allclose(dother, ref[4].grad)
    assert torch.allclose(w1.grad, ref[1].grad) and torch.allclose(w2.grad, ref[2].grad)
    assert torch.allclose(bias.grad, ref[3].grad)


def test_a_sum_all_reduce_on_the_given_group(monkeypatch) -> None:
    """Kills: another reduce op, the group dropped, a non-contiguous tensor handed to
    the collective, a synchronous launch where one in flight is wanted, a wait that
    does not wait (or waits twice), the tp 1 shortcut taken at tp 2."""
    seen: list[dict] = []

    def all_reduce(tensor, op=None, group=None, async_op=False):  # noqa: ANN001
        seen.append(dict(op=op, group=group, async_op=async_op,
                         contiguous=tensor.is_contiguous()))
        tensor.mul_(3)  # three ranks holding the same
        return work if async_op else None

    work = _Work()
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    group = object()
    x = torch.ones(3, 2).t()
    reduced = comm.make_allreduce(group, 2)(x)  # type: ignore[arg-type]
    assert torch.equal(reduced, torch.full((2, 3), 3.0))
    assert seen[-1] == dict(op=dist.ReduceOp.SUM, group=group, async_op=False, contiguous=True)
    pending = comm.start_allreduce(torch.ones(3, 2).t(), group, 2)  # type: ignore[arg-type]
    assert seen[-1] == dict(op=dist.ReduceOp.SUM, group=group, async_op=True, contiguous=True)
    assert work.waits == 0
    assert torch.equal(pending.wait(), torch.full((2, 3), 3.0)) and work.waits == 1
    pending.wait()
    assert work.waits == 1
    assert comm.identity_allreduce(x) is x


def test_launch_sum_calls_the_group_with_an_async_sum(monkeypatch) -> None:
    """Kills: another op, a synchronous launch, a copy of the tensor handed over, and
    the default group not the world."""

    class _Group:
        def __init__(self) -> None:
            self.seen: list = []

        def allreduce(self, tensors, opts):  # noqa: ANN001
            self.seen.append((tensors, opts.reduceOp, opts.asyncOp))
            return "work"

    mine, world = _Group(), _Group()
    _world_is(monkeypatch, comm, world)
    x = torch.ones(2)
    assert comm.launch_sum(x, mine) == "work"  # type: ignore[arg-type]
    assert comm.launch_sum(x, None) == "work"
    for g in (mine, world):
        ((tensors, op, async_op),) = g.seen
        assert tensors[0] is x and len(tensors) == 1
        assert op == dist.ReduceOp.SUM and async_op is True


def test_no_process_group_is_named_not_a_none_call(monkeypatch) -> None:
    """Kills: the message of the launches' no-world assertion changed (the one line a
    caller that forgot init_process_group sees, instead of a call on None)."""
    for module in (comm, sequence):
        _world_is(monkeypatch, module, None)
    with pytest.raises(AssertionError, match="^torch.distributed is not initialised$"):
        comm.launch_sum(torch.ones(1), None)
    with pytest.raises(AssertionError, match="^torch.distributed is not initialised$"):
        SequenceParallel(None, 2, 0).launch_scatter(torch.zeros(1, 2, 1))


def test_deferred_linear_with_bias_and_without_input_grad() -> None:
    """Kills: the bias gradient not deferred (or not summed over tokens), an input
    gradient made when none is needed, the mixed-dtype W path (bf16 dy on an fp32
    weight) rounding or skipping. Reference: F.linear under autograd."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4, dtype=D, generator=gen)
    w = torch.nn.Parameter(torch.randn(5, 4, dtype=D, generator=gen))
    b = torch.nn.Parameter(torch.randn(5, dtype=D, generator=gen))
    sink: list = []
    y = linear(x, w, sink, b)
    dy = torch.randn(2, 3, 5, dtype=D, generator=gen)
    y.backward(dy)
    assert w.grad is None and b.grad is None and len(sink) == 1
    sink[0].accumulate()
    sink[0].accumulate()
    wr, br = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    F.linear(x, wr, br).backward(dy)
    assert torch.allclose(w.grad, 2 * wr.grad) and torch.allclose(b.grad, 2 * br.grad)
    assert torch.allclose(y, F.linear(x, w, b))

    # a bf16 output gradient into an fp32 weight: W casts, on the first and later adds
    w32 = torch.nn.Parameter(torch.zeros(5, 4))
    dy16 = dy.to(torch.bfloat16)
    x32 = x.float()
    for _ in range(2):
        LinearGrad(w32, x32.to(torch.bfloat16), dy16).accumulate()
    dy2, x2 = dy16.reshape(-1, 5), x32.to(torch.bfloat16).reshape(-1, 4)
    ref = (dy2.t() @ x2).float() + dy2.float().t() @ x2.float()  # first in bf16, then fp32
    assert w32.grad.dtype == torch.float32 and torch.allclose(w32.grad, ref, atol=1e-5)
    LinearGrad(w32, x32, dy.float()).accumulate()  # same dtype: addmm_ in place
    assert torch.allclose(w32.grad, ref + dy.float().reshape(-1, 5).t() @ x32.reshape(-1, 4),
                          atol=1e-4)


def test_grad_taps_defer_the_weight_gradient_from_the_engines_walk() -> None:
    """Kills: a tap that records nothing, `caught` dropping gradients (or keeping None
    ones), taps not cleared after B, and the edges out of order. Reference: F.linear
    under autograd."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, dtype=D, generator=gen, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=gen))
    w2 = torch.nn.Parameter(torch.randn(2, 4, dtype=D, generator=gen))
    b2 = torch.nn.Parameter(torch.randn(2, dtype=D, generator=gen))
    sink: list = []
    taps = GradTaps(sink)
    y = linear(linear(x, w1, taps), w2, taps, b2)
    dy = torch.randn(3, 2, dtype=D, generator=gen)
    dx, *at = torch.autograd.grad(y, (x, *taps.edges()), dy)
    taps.caught(at)
    assert taps.edges() == () and len(sink) == 2
    for e in sink:
        e.accumulate()
    ref = [t.detach().clone().requires_grad_(True) for t in (x, w1, w2, b2)]
    F.linear(F.linear(ref[0], ref[1]), ref[2], ref[3]).backward(dy)
    assert torch.allclose(dx, ref[0].grad)
    for p, r in zip((w1, w2, b2), ref[1:], strict=True):
        assert torch.allclose(p.grad, r.grad)
    w3 = torch.nn.Parameter(torch.ones(1, 1, dtype=D))
    taps.linear(w3, x, x, None)
    taps.caught([None])
    assert sink[2:] == []
    with pytest.raises(ValueError):
        taps.linear(w3, x, x, None)
        taps.caught([])


def test_embed_and_ready_gradients_accumulate_into_grad() -> None:
    """Kills: an embedding gradient that overwrites instead of adding repeated ids, a
    starting .grad that is not zeros, a ReadyGrad that does nothing, and
    accumulate_grad keeping a wrong dtype or replacing instead of adding."""
    w = torch.nn.Parameter(torch.zeros(4, 2, dtype=D))
    ids = torch.tensor([1, 3, 1])
    dy = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float32)
    EmbedGrad(w, ids, dy).accumulate()
    EmbedGrad(w, ids, dy).accumulate()
    assert torch.equal(w.grad, 2 * torch.tensor([[0, 0], [6, 8], [0, 0], [3, 4]], dtype=D))
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    ReadyGrad(p, torch.tensor([1.0, 2.0])).accumulate()
    accumulate_grad(p, torch.tensor([0.5, 0.5], dtype=D))
    assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad.float(), torch.tensor([1.5, 2.5]))


def test_wgrad_store_discards_and_lists_the_tensors_it_holds() -> None:
    """Kills: discard that keeps the work (or fails on an unknown microbatch),
    pending() unsorted, tensors() missing a tensor or listing a non-tensor."""
    store = WGradStore()
    w = torch.nn.Parameter(torch.zeros(2, 3))
    x, dy = torch.ones(4, 3), torch.ones(4, 2)
    store.open(5).append(LinearGrad(w, x, dy))
    store.open(2)
    assert store.pending() == [2, 5]
    assert [id(t) for t in store.tensors(5)] == [id(w), id(x), id(dy)]
    assert store.tensors(7) == []
    store.discard(5)
    store.discard(9)
    assert store.pending() == [2] and store.tensors(5) == []


def test_rms_norm_plain_path_and_low_precision_statistics() -> None:
    """Kills: the plain path's eps or mean changed, the statistics taken in bf16 (a
    promotion that does not reach float32), the output not cast back. Reference:
    F.rms_norm in float32 rounded to bf16."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 16, generator=gen) * 30
    g = 1 + 0.1 * torch.randn(16, generator=gen)
    ref = F.rms_norm(x, (16,), g, 1e-2)
    assert torch.allclose(rms_norm(x, g, 1e-2, None), ref, atol=1e-6)
    low = rms_norm(x.to(torch.bfloat16), g, 1e-2, None)
    ref_low = F.rms_norm(x.to(torch.bfloat16).float(), (16,), g, 1e-2).to(torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, ref_low)
    sink: list = []
    deferred = rms_norm(x.to(torch.bfloat16), g, 1e-2, GradTaps(sink))
    assert deferred.dtype == torch.bfloat16 and torch.equal(deferred, ref_low)


def test_cross_entropy_with_ignored_targets_and_vocabulary_padding() -> None:
    """Kills: ignored targets counted in the loss or given a gradient, the padding
    columns (index >= vocab_valid) kept in the softmax, `>=` turned `>`, a gradient
    divided by the valid tokens instead of the positions. Reference: F.cross_entropy
    over the real vocabulary with ignore_index, summed / positions."""
    gen = torch.Generator().manual_seed(7)
    tp, real, padded = 2, 5, 6  # the second rank's last column is padding
    logits = torch.randn(2, 4, padded, dtype=D, generator=gen)
    targets = torch.randint(0, real, (2, 4), generator=gen)
    targets[0, 1] = targets[1, 3] = IGNORE_INDEX
    shards = logits.chunk(tp, dim=-1)
    valid = [3, 2]
    stats = sum(vocab_ce_stats(shards[t], targets, 3 * t, tp, t, valid[t]) for t in range(tp))
    loss, lse = vocab_ce_finish(stats, targets)
    ref_logits = logits[..., :real].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="sum",
                          ignore_index=IGNORE_INDEX) / targets.numel()
    ref.backward(torch.tensor(2.0, dtype=D))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    two = torch.tensor(2.0)
    grads = torch.cat([vocab_ce_grad(shards[t], targets, lse, 3 * t, two, valid[t])
                       for t in range(tp)], dim=-1)
    assert torch.allclose(grads[..., :real], ref_logits.grad, rtol=0, atol=1e-12)
    assert torch.equal(grads[..., real:], torch.zeros(2, 4, 1, dtype=D))
    assert valid_token_ratio(targets) == 8 / 6
    assert valid_token_ratio(torch.full((3,), IGNORE_INDEX)) == 3.0
    assert valid_token_ratio(torch.zeros(4, dtype=torch.long)) == 1.0
