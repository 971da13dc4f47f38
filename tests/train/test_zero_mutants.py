"""stp.train.step.zero in one process: DP ranks as threads, against torch's AdamW.

Written to kill mutants mutmut left alive in stp/train/step/zero.py
(docs/testing.md): its other tests run the sharded optimizer in spawned ranks,
which mutmut cannot map to mutants. Here each DP rank is a thread of the pytest
process and `DPGroup.run` (the one door the module's collectives go through) is
a reduce-scatter / all-gather over those threads, written out by hand. The
reference: torch's AdamW stepping the whole parameters with the DP mean of the
ranks' gradients. Each test names the bug it guards against.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  imported by the first optimizer step: 40 s a mutant here
import torch.distributed as dist
from torch import nn

from stp.train.checkpoint.shards import Box
from stp.train.step.zero import DPGroup, ShardedPrecision

SHAPES = [(5, 3), (2,), (1, 4)]
"""Rows that split unevenly over 2 ranks (3 + 2), in 2 (1 + 1), and in 1 (1 + 0)."""


class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


class _Threads:
    """`size` DP ranks as threads; `run` is DPGroup.run: each collective is complete
    on every rank once all of them have called it (a real group's semantics)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size
        self.actions: list[tuple[int, str, str, bool]] = []
        self.works: list[_Work] = []
        self.buffers: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []
        """(rank, action, out, in) of each collective call."""
        self.waited: list[tuple[int, str, str]] = []
        """(rank, action, peers) of each work's wait run through DPGroup.run."""
        self.lock = threading.Lock()

    def group(self, rank: int, mean_over: int | None = None) -> DPGroup:
        def run(action: str, peers: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            if fn is dist.reduce_scatter_single:
                return self._collective(rank, action, peers, self._reduce_scatter, *args, **kw)
            if fn is dist.all_gather_single:
                return self._collective(rank, action, peers, self._all_gather, *args, **kw)
            with self.lock:
                self.waited.append((rank, action, peers))
            return fn(*args, **kw)  # a work's wait

        return DPGroup(self.size, rank, "the dp group", run, "a DP peer", mean_over)

    def _collective(self, rank: int, action: str, peers: str, how: Callable[..., None],
                    out: torch.Tensor, inp: torch.Tensor, *, group: Any,
                    async_op: bool) -> _Work | None:
        assert group == "the dp group"
        with self.lock:
            self.actions.append((rank, action, peers, async_op))
            self.buffers.append((rank, action, out, inp))
        self.slots[rank] = inp.clone()
        self.barrier.wait()
        how(rank, out)
        self.barrier.wait()
        if not async_op:
            return None
        with self.lock:
            self.works.append(_Work())
            return self.works[-1]

    def _reduce_scatter(self, rank: int, out: torch.Tensor) -> None:
        total = sum(self.slots)
        out.copy_(total.chunk(self.size)[rank])

    def _all_gather(self, rank: int, out: torch.Tensor) -> None:
        out.copy_(torch.cat(self.slots))

    def each(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on every rank at once; their results in rank order."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _model(dtype: torch.dtype) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(1)
    return [(f"p{k}", nn.Parameter(torch.randn(s, generator=gen).to(dtype)))
            for k, s in enumerate(SHAPES)]


def _grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + rank)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _mean_grads(size: int) -> list[torch.Tensor]:
    return [sum(gs) / size for gs in zip(*(_grads(r) for r in range(size)), strict=True)]


def _torch_reference(dtype: torch.dtype, size: int, steps: int) -> list[torch.Tensor]:
    ref = [nn.Parameter(p.detach().float().clone()) for _, p in _model(dtype)]
    opt = torch.optim.AdamW(ref, lr=0.1, foreach=False)
    for _ in range(steps):
        for p, g in zip(ref, _mean_grads(size), strict=True):
            p.grad = g.to(dtype).float()
        opt.step()
    return [p.detach() for p in ref]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_sharded_steps_are_torchs_adamw_on_the_dp_mean(dtype: torch.dtype) -> None:
    """Kills: a rank stepping another rank's rows (rows_of / local at the wrong rank),
    the reduce-scatter's sum not divided by dp, the packed layout or the gather's
    unpacking at wrong offsets, masters not copied (mixed) or the pure shards a
    copy (the model then never updated), main grads not zeroed, a shard's .grad not
    a view of the reduce-scattered segment. Two ranks, rows 5, 2, 1: uneven and
    empty chunks."""
    world = _Threads(2)

    def rank_run(rank: int) -> list[torch.Tensor]:
        named = _model(dtype)
        prec = ShardedPrecision(named, [], world.group(rank))
        opt = torch.optim.AdamW(prec.params, lr=0.1, foreach=False)
        for _ in range(2):
            prec.zero_grad()
            for (_, p), g in zip(named, _grads(rank), strict=True):
                p.grad = g.to(dtype)
            prec.fold()
            prec.reduce_scatter()
            opt.step()
            prec.copy_to_model()
        return [p.detach().float() for _, p in named]

    ref = _torch_reference(dtype, 2, 2)
    for got in world.each(rank_run):
        for mine, theirs in zip(got, ref, strict=True):
            if dtype == torch.float32:
                assert torch.allclose(mine, theirs, rtol=0, atol=1e-6)
            else:
                assert torch.equal(mine, theirs.to(dtype).float())
    assert {a for _, a, _, _ in world.actions} == {"DP gradient reduce-scatter",
                                                   "parameter all-gather"}
    assert {p for _, _, p, _ in world.actions} == {"a DP peer"}


def test_packed_main_grads_a_stage_at_a_time_in_flight() -> None:
    """Kills: group_main_grads not packing (or packing the wrong tensors), a W's fold
    into the packed chunks lost, a group reduced twice or not at all when the indices
    cover it, a subset's result copied to the wrong places of the segment, async
    launches that wait at once, whole main grads of packed parameters not rebuilt
    from their chunks, zero_grad missing the packed buffers, the packed main grads
    held by their flight as if a copy (`stp memory` and the trace would count them
    as bytes the reduction adds), a packed copy not held by its flight (the backend
    would read freed memory), a subset's copy launched synchronously, a flight
    finished without waiting for its work (or waiting outside DPGroup.run, or with
    the action or peers dropped from what a timeout would name)."""
    world = _Threads(2)

    def rank_run(rank: int) -> dict:
        named = _model(torch.bfloat16)
        prec = ShardedPrecision(named, [], world.group(rank))
        buffers = prec.group_main_grads([[2, 0]])
        assert [b.numel() for b in buffers] == [2 * (3 * 3 + 1 * 4)]
        assert prec.main_grads[0] is None and prec.main_grads[1] is not None
        assert len(prec.grad_buffers()) == 2
        for (_, p), g in zip(named, _grads(rank), strict=True):
            p.grad = g.to(torch.bfloat16)
        prec.fold([2, 0])
        prec.fold()
        whole = [g.clone() for g in prec.full_grads()]
        first = prec.reduce_scatter([0, 2], async_op=True)
        waits_before = [f.work.waits for f in first]
        packed_kept = any(t.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()
                          for f in first for t in f.keep)
        for f in first:
            f.finish()
        rest = prec.reduce_scatter([1], async_op=True)  # from a packed copy
        _, _, out, inp = [b for b in world.buffers if b[0] == rank][-1]
        copy_kept = {t.data_ptr() for t in rest[0].keep} == {out.data_ptr(), inp.data_ptr()}
        for f in rest:
            f.finish()
        shards = [g.clone() for g in prec.grads()]
        prec.zero_grad()
        zeroed = all(float(b.abs().sum()) == 0 for b in prec.grad_buffers())
        return dict(whole=whole, waits=waits_before, shards=shards, zeroed=zeroed,
                    rows=[prec._rows(i) for i in range(3)], packed_kept=packed_kept,
                    copy_kept=copy_kept)

    got = world.each(rank_run)
    for rank, r in enumerate(got):
        for w, g in zip(r["whole"], _grads(rank), strict=True):
            assert torch.equal(w, g.to(torch.bfloat16).float())
        assert r["waits"] == [0] and r["zeroed"] and not r["packed_kept"] and r["copy_kept"]
        for k, ((start, stop), shard) in enumerate(zip(r["rows"], r["shards"], strict=True)):
            mean = sum(_grads(q)[k].to(torch.bfloat16).float() for q in range(2)) / 2
            assert torch.allclose(shard, mean[start:stop], rtol=0, atol=1e-6)
    assert got[0]["rows"] == [(0, 3), (0, 1), (0, 1)]
    assert got[1]["rows"] == [(3, 5), (1, 2), (1, 1)]
    assert [a[3] for a in world.actions] == [True] * 4  # both launches, on both ranks
    assert [w.waits for w in world.works] == [1] * 4
    assert sorted(world.waited) == [(r, "DP gradient reduce-scatter", "a DP peer")
                                    for r in (0, 0, 1, 1)]


def test_experts_are_sharded_over_their_own_group_and_divided_by_dp() -> None:
    """Kills: the expert section missing (experts sharded over DP), the expert
    indices taken from the dense names, a section's divisor its group size instead
    of dp (mean_over ignored), a reduce-scatter of the experts alone skipped because
    no dense parameter was wanted (`continue` made `break`). EDP of one rank at dp 2:
    the expert's gradient is its own sum, halved."""
    world = _Threads(1)
    named = _model(torch.float32)
    experts = (world.group(0, mean_over=2), frozenset({"p1"}))
    dense_world = _Threads(1)
    prec = ShardedPrecision(named, [], dense_world.group(0), experts)
    assert [s.index for s in prec.sections] == [[0, 2], [1]]
    for (_, p), g in zip(named, _grads(0), strict=True):
        p.grad = g
    prec.reduce_scatter()
    grads = prec.grads()
    assert torch.equal(grads[0], _grads(0)[0])  # dense: a group of one, divided by 1
    assert torch.equal(grads[1], _grads(0)[1] / 2)
    assert len(world.actions) == 1 and len(dense_world.actions) == 1
    prec.all_gather([1])
    assert len(world.actions) == 2 and len(dense_world.actions) == 1
    named[1][1].grad = _grads(0)[1] * 3  # the experts alone: no dense parameter wanted
    prec.reduce_scatter([1])
    assert torch.equal(prec.grads()[1], _grads(0)[1] * 3 / 2)
    assert len(world.actions) == 3 and len(dense_world.actions) == 1


def test_a_subset_all_gather_rebuilds_only_its_parameters() -> None:
    """Kills: all_gather of a subset gathering every parameter (or the wrong ones),
    its layout the section's (or the section's whole layout not used when the subset
    is every parameter), an async gather written before it is finished, launched
    synchronously, finished without waiting for its work (or waiting outside
    DPGroup.run, or with the action or peers dropped: a stalled peer's timeout would
    not say what it waited on), its send and receive buffers not kept by the flight
    while in flight (the backend would write into freed memory)."""
    world = _Threads(2)

    def rank_run(rank: int) -> dict:
        named = _model(torch.bfloat16)  # masters apart from the model
        prec = ShardedPrecision(named, [], world.group(rank))
        with torch.no_grad():
            for shard in prec.params:
                shard.fill_(rank + 1.0)
        flights = prec.all_gather([0], async_op=True)
        _, _, out, inp = next(b for b in world.buffers if b[0] == rank)
        kept = {t.data_ptr() for t in flights[0].keep} == {out.data_ptr(), inp.data_ptr()}
        before = named[0][1].detach().clone()
        for f in flights:
            f.finish()
        after_first = [p.detach().clone() for _, p in named]
        prec.all_gather([2, 1])
        return dict(before=before, first=after_first, kept=kept,
                    second=[p.detach().clone() for _, p in named])

    model = [p.detach() for _, p in _model(torch.bfloat16)]
    gathered0 = torch.cat([torch.full((3, 3), 1.0), torch.full((2, 3), 2.0)])
    for r in world.each(rank_run):
        assert torch.equal(r["before"], model[0]) and r["kept"]
        assert torch.equal(r["first"][0].float(), gathered0)
        assert torch.equal(r["first"][1], model[1]) and torch.equal(r["first"][2], model[2])
        assert torch.equal(r["second"][0].float(), gathered0)
        assert torch.equal(r["second"][1].float(), torch.tensor([1.0, 2.0]))
        assert torch.equal(r["second"][2].float(), torch.full((1, 4), 1.0))  # rank 1: no row
    assert [a[3] for a in world.actions] == [True, True, False, False]
    assert [w.waits for w in world.works] == [1, 1]
    assert sorted(world.waited) == [(0, "parameter all-gather", "a DP peer"),
                                    (1, "parameter all-gather", "a DP peer")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_collective_buffers_are_on_the_parameters_device_in_the_wire_dtype(
        dtype: torch.dtype) -> None:
    """Kills: a buffer handed to a reduce-scatter or an all-gather, or a packed main
    grad rebuilt whole, made on the default device instead of the parameters' (a GPU
    run would hand NCCL host memory; here the parameters are on torch's meta device,
    so a CPU buffer shows), the reduce-scatter's packed copy made in the default dtype
    (float32: a float64 run's gradients rounded), the all-gather's buffers in the
    default dtype instead of the model's (a bf16 run would move twice the bytes), the
    whole section's reduce-scatter written to a copy instead of straight into the
    segment the shards' .grad view."""
    world = _Threads(1)
    named = [(f"p{k}", nn.Parameter(torch.zeros(s, dtype=dtype, device="meta")))
             for k, s in enumerate(SHAPES)]
    prec = ShardedPrecision(named, [], world.group(0))
    for _, p in named:
        p.grad = torch.zeros_like(p)
    if prec.mixed:
        prec.fold()
    prec.reduce_scatter()  # the whole section, from a packed copy
    assert world.buffers[-1][2] is prec.shard_grads
    prec.reduce_scatter([1])  # a subset
    if prec.mixed:
        prec.group_main_grads([[2, 0]])
        prec.reduce_scatter([0, 2])  # straight from the packed main grads
        whole = prec.full_grads([0])[0]
        assert (whole.device.type, whole.dtype, whole.shape) == ("meta", torch.float32, (5, 3))
    prec.all_gather([1])
    prec.copy_to_model()
    grad_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    assert len(world.buffers) == 4 + prec.mixed
    for _, action, out, inp in world.buffers:
        wire = grad_dtype if action == "DP gradient reduce-scatter" else dtype
        assert (out.device.type, inp.device.type) == ("meta", "meta")
        assert (out.dtype, inp.dtype) == (wire, wire)


def test_norm_keys_and_boxes_carry_the_shards_rows() -> None:
    """Kills: the rows left out of the norm key (two DP shards of one parameter would
    count as the same gradient), the optimizer box not cut to the rows."""
    world = _Threads(2)

    def rank_run(rank: int) -> tuple:
        prec = ShardedPrecision(_model(torch.float32), [], world.group(rank))
        box = prec.optimizer_box(0, Box(torch.Size([5, 3]), torch.Size([0, 0])))
        return prec.norm_keys(["a", "b", "c"]), box

    (keys0, box0), (keys1, box1) = world.each(rank_run)
    assert keys0 == [("a", (0, 3)), ("b", (0, 1)), ("c", (0, 1))]
    assert keys1 == [("a", (3, 5)), ("b", (1, 2)), ("c", (1, 1))]
    assert tuple(box0.offsets) == (0, 0) and tuple(box1.offsets) == (3, 0)


def test_bad_parameters_and_groups_are_refused_in_one_line() -> None:
    """Kills: a scalar or a non-contiguous parameter accepted, two dtypes accepted,
    the messages losing the name or the dtypes, a DP rank outside the group accepted
    (either bound)."""
    world = _Threads(1)
    group = world.group(0)
    with pytest.raises(ValueError, match=r"along dim 0: 's' is a scalar"):
        ShardedPrecision([("s", nn.Parameter(torch.tensor(1.0)))], [], group)
    with pytest.raises(ValueError, match=r"along dim 0: 't' is not contiguous"):
        ShardedPrecision([("t", nn.Parameter(torch.zeros(3, 2).t()))], [], group)
    with pytest.raises(ValueError) as err:
        ShardedPrecision([("a", nn.Parameter(torch.zeros(2))),
                          ("b", nn.Parameter(torch.zeros(2, dtype=torch.float64)))], [], group)
    assert str(err.value) == ("the sharded optimizer needs one parameter dtype, got "
                              "['torch.float32', 'torch.float64']")
    for rank in (-1, 2):
        with pytest.raises(ValueError, match=rf"DP rank {rank} is not in \[0, 2\)"):
            DPGroup(2, rank, None, lambda *a, **k: None)
    assert DPGroup(2, 1, None, lambda *a, **k: None).divisor == 2
    assert DPGroup(2, 0, None, lambda *a, **k: None, mean_over=4).divisor == 4


def test_a_pure_model_is_sharded_in_place() -> None:
    """Kills: the pure shards made copies, main grads kept for a pure model,
    full_grads not creating a missing gradient, grads() not re-attaching the views
    an optimizer's zero_grad dropped."""
    world = _Threads(1)
    named = _model(torch.float32)
    prec = ShardedPrecision(named, [], world.group(0))
    assert not prec.mixed and prec.main_grads == [] and prec.group_main_grads([[0]]) == []
    assert all(s.data_ptr() == p.data_ptr() for s, (_, p) in zip(prec.params, named,
                                                                  strict=True))
    full = prec.full_grads([1])
    assert torch.equal(full[0], torch.zeros(2)) and named[1][1].grad is full[0]
    assert prec.grad_buffers() == prec.full_grads()
    for p in prec.params:
        p.grad = None
    grads = prec.grads()
    assert all(g is not None and g.data_ptr() >= prec.shard_grads.data_ptr() for g in grads)


class _Unit:
    """A unit as stp.models makes them: its W sets the weight's bf16 gradient."""

    def __init__(self, w: nn.Parameter) -> None:
        self.w = w

    def weight(self, g: torch.Tensor) -> None:
        self.w.grad = g.to(self.w.dtype)


def test_a_units_weight_gradients_are_folded_into_fp32_main_grads() -> None:
    """Kills: the units not handed on to Precision (their W then folds nothing: the
    second W's gradient replaces the first on the model's .grad, and the packed main
    grad stays zero), whole main grads made in the model's bf16 instead of fp32
    (1 + 2^-8, the sum of two W's, rounds to 1 in bf16)."""
    world = _Threads(1)
    named = _model(torch.bfloat16)
    unit, whole_unit = _Unit(named[0][1]), _Unit(named[1][1])
    prec = ShardedPrecision(named, [unit, whole_unit], world.group(0))
    prec.group_main_grads([[0, 2]])
    g = _grads(0)[0]
    unit.weight(g)
    unit.weight(g)
    assert named[0][1].grad is None
    assert torch.equal(prec.full_grads([0])[0], 2 * g.to(torch.bfloat16).float())
    whole_unit.weight(torch.ones(2))
    whole_unit.weight(torch.full((2,), 2.0 ** -8))
    assert torch.equal(prec.full_grads([1])[0], torch.full((2,), 1 + 2.0 ** -8))


def test_one_parameter_or_none() -> None:
    """Kills: the device read from a second parameter (a rank holding one fails), or
    from the first when there is none (a rank holding no parameter fails), or the
    empty model's fallback device misspelt."""
    world = _Threads(1)
    one = ShardedPrecision([("w", nn.Parameter(torch.ones(2)))], [], world.group(0))
    assert one.shard_grads.shape == (2,) and len(one.params) == 1
    empty = ShardedPrecision([], [], world.group(0))
    assert empty.params == [] and empty.grads() == [] and empty.shard_grads.numel() == 0
