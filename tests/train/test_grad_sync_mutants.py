"""stp.train.step.grad_sync in one process, against hand counts.

Written to kill mutants mutmut left alive in stp/train/step/grad_sync.py
(docs/testing.md): its other tests run two DP replicas in spawned ranks, which
mutmut cannot map to mutants. Here rank 0 of a dp 2 mesh runs alone and
`torch.distributed` is faked in the module: the other replica's contribution to
every all-reduce is a known constant, so the average, the loss and the norm are
hand counts. Each test names the bug it guards against.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stp.runtime.errors import PeerLost, RankError
from stp.train.step import grad_sync
from stp.train.step.grad_sync import WORLD, GradSync, _stage_params, _views_of, collective
from stp.train.step.precision import Precision

OTHER = 10.0
"""What the other replica adds to every element of every all-reduce."""


class _Work:
    def __init__(self, done: bool = True) -> None:
        self.done, self.waits = done, 0

    def wait(self) -> None:
        self.waits += 1
        self.done = True

    def is_completed(self) -> bool:
        return self.done


class _Dist:
    """The torch.distributed grad_sync sees: rank 0 of two, the other adding OTHER."""

    def __init__(self, done: bool = True) -> None:
        self.calls: list[dict] = []
        self.works: list[_Work] = []
        self.done = done

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: ANN001
        self.calls.append(dict(group=group, async_op=async_op, op=op, numel=tensor.numel(),
                               dtype=tensor.dtype))
        tensor.add_(OTHER)
        if not async_op:
            return None
        self.works.append(_Work(self.done))
        return self.works[-1]

    def all_gather_object(self, out: list, mine: tuple) -> None:
        for r in range(len(out)):
            out[r] = (r, mine[1])  # the other replica holds the same keys


def _mesh(dp: int = 2, tp_coord: int = 0, edp: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        dims=SimpleNamespace(dp=dp, tp=1, world_size=dp), coord=SimpleNamespace(tp=tp_coord),
        rank=0, dp_group="dp group", edp_group="edp group",
        ranks={"dp": list(range(dp)), "edp": list(range(edp))},
        describe=lambda: "rank 0 (pp 0, tp 0, dp 0)",
        describe_group=lambda axis: f"the {axis} group")


class _Stage:
    def __init__(self, experts: tuple[str, ...] = (), **weights: nn.Parameter) -> None:
        self.weights, self.expert_names = weights, experts

    def named_parameters(self):
        yield from self.weights.items()

    def shard_dim(self, name: str) -> None:
        return None


def _setup(monkeypatch, dtype=torch.float64, overlap=False, done=True, experts=(),  # noqa: ANN001
           shared=None, mesh=None, holds_loss=True):  # noqa: ANN001
    fake = _Dist(done)
    monkeypatch.setattr(grad_sync, "dist", fake)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)  # read by clip.counted_mask
    a = nn.Parameter(torch.zeros(3, dtype=dtype))
    b = nn.Parameter(torch.zeros(2, dtype=dtype))
    c = nn.Parameter(torch.zeros(4, dtype=dtype))
    stages = {1: _Stage(experts, a=a, b=b), 0: _Stage((), c=c)}
    named = [("a", a), ("b", b), ("c", c)]
    precision = Precision(named)
    sync = GradSync(mesh or _mesh(), precision, stages, shared=shared, holds_loss=holds_loss,
                    device=torch.device("cpu"), overlap=overlap)
    grads = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0]),
             torch.tensor([6.0, 7.0, 8.0, 9.0])]
    for (_, p), g in zip(named, grads, strict=True):
        p.grad = g.to(dtype)
    return sync, fake, named, grads


def _averaged(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(g.double() + OTHER) / 2 for g in grads]


def _norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads) + OTHER)


def test_after_backward_averages_sums_the_loss_and_takes_the_norm(monkeypatch) -> None:
    """Kills: the average not divided by dp (or by something else), a gradient not
    reduced or copied back at the wrong offset, the loss not divided by microbatches x
    dp or not scaled by the valid ratio, the loss not summed over the world, the norm
    of the gradients before the average, the extra values dropped."""
    sync, fake, named, grads = _setup(monkeypatch)
    losses = {0: torch.tensor(2.0, dtype=torch.float64), 1: torch.tensor(4.0)}
    loss, norm = sync.after_backward(losses, 2, 1.5, torch.tensor([7.0, 8.0]))
    got = [p.grad for _, p in named]
    for g, ref in zip(got, _averaged(grads), strict=True):
        assert torch.equal(g, ref)
    assert loss == (2.0 + 4.0) / (2 * 2) * 1.5 + OTHER
    assert norm == pytest.approx(_norm(got), rel=1e-14)
    assert sync.extra_values == [7.0, 8.0]
    grads_call = [c for c in fake.calls if c["numel"] == 9]
    assert len(grads_call) == 1 and grads_call[0]["group"] == "dp group"
    assert all(c["op"] == dist.ReduceOp.SUM for c in fake.calls)
    assert sync.after_backward({}, 2, 1.0)[0] == OTHER  # no loss here: only the world's


@pytest.mark.parametrize("holds_loss,tp_coord", [(False, 0), (True, 1)])
def test_only_tp_rank_0_of_the_last_stage_adds_the_loss(monkeypatch, holds_loss: bool,
                                                        tp_coord: int) -> None:
    """Kills: the loss counted on a rank off the last stage or on every TP rank
    (`and` turned `or`, the tp coordinate test changed)."""
    sync, _, _, _ = _setup(monkeypatch, holds_loss=holds_loss, mesh=_mesh(tp_coord=tp_coord))
    total = sync.world_loss({0: torch.tensor(3.0)}, 1, 1.0, action="eval loss")
    assert total == OTHER


def test_the_loss_is_a_float64_sum_in_order(monkeypatch) -> None:
    """Kills: the microbatch losses summed in their own dtype (float16 here, whose
    sum of 2048 and 1 is 2048), or the total made float32."""
    sync, fake, _, _ = _setup(monkeypatch)
    half = torch.float16
    losses = {0: torch.tensor(2048.0, dtype=half), 1: torch.tensor(1.0, dtype=half)}
    assert sync.world_loss(losses, 1, 1.0) == 2049.0 / 2 + OTHER
    assert fake.calls[-1]["dtype"] == torch.float64


def test_an_overlapped_stage_is_launched_in_flight_and_finished_after(monkeypatch) -> None:
    """Kills: stage_final doing nothing with the overlap on (or launching with it off /
    at dp 1), a launch that waits at once, the stage's reduction repeated after the
    backward, in-flight reductions not finished before the shared sum, held_bytes
    not counting the flat copy, start_step not finishing what is in flight."""
    sync, fake, named, grads = _setup(monkeypatch, overlap=True, done=False)
    assert sync.overlap
    sync.stage_final(1)  # parameters a and b
    assert [c["async_op"] for c in fake.calls] == [True] and fake.calls[0]["numel"] == 5
    assert fake.works[0].waits == 0
    assert sync.held_bytes() == 5 * 8
    assert torch.equal(named[0][1].grad, grads[0].double())  # not finished yet
    sync.after_backward({0: torch.tensor(1.0)}, 1, 1.0)
    assert fake.works[0].waits == 1 and sync.held_bytes() == 0
    numels = [c["numel"] for c in fake.calls]
    assert numels.count(5) == 1 and numels.count(4) == 1  # c reduced after, once
    for (_, p), ref in zip(named, _averaged(grads), strict=True):
        assert torch.equal(p.grad, ref)
    sync.stage_final(0)
    sync.start_step()
    assert fake.works[-1].waits == 1 and sync._in_flight == [] and sync._reduced == set()
    off, fake_off, _, _ = _setup(monkeypatch, overlap=False)
    off.stage_final(1)
    assert fake_off.calls == []
    single, fake_one, _, _ = _setup(monkeypatch, overlap=True, mesh=_mesh(dp=1))
    assert not single.overlap


def test_completed_reductions_are_finished_oldest_first_at_the_next_launch(monkeypatch) -> None:
    """Kills: _finish_completed finishing one that is not complete, or stopping
    after the first (or never finishing any), and the sampler not called."""
    sync, fake, named, grads = _setup(monkeypatch, overlap=True, done=True)
    samples: list[int] = []
    sync.sampler = lambda: samples.append(1)
    sync.stage_final(1)
    fake.done = False
    sync.stage_final(0)  # finishes stage 1's (complete) first
    assert torch.equal(named[0][1].grad, _averaged(grads)[0])
    assert len(sync._in_flight) == 1 and samples == [1, 1]
    assert torch.equal(named[2][1].grad, grads[2].double())  # stage 0's still in flight
    sync.finish_reductions()
    assert torch.equal(named[2][1].grad, _averaged(grads)[2])


def test_bf16_main_grads_are_folded_and_reduced_in_place_per_stage(monkeypatch) -> None:
    """Kills: the fold into the main grads skipped at stage_final, the stage groups not
    made (or made at dp 1 / for a pure model), a group reduced from a copy (keep not
    empty) when its main grads are views of it, the experts' group in the dense one."""
    sync, fake, named, grads = _setup(monkeypatch, dtype=torch.bfloat16, overlap=True,
                                      done=False, experts=("b",))
    assert [idx for idx, _ in sync.flat_grads] == [[0], [1], [2]]
    sync.stage_final(1)
    assert all(p.grad is None for _, p in named[:2])  # folded
    assert [(c["numel"], c["group"]) for c in fake.calls] == [(3, "dp group"), (2, "edp group")]
    assert sync.held_bytes() == 0  # in place: no copy held
    assert named[2][1].grad is not None  # stage 0's not folded yet
    sync.stage_final(0)
    sync.after_backward({}, 1, 1.0)
    main = sync.precision.grads()
    for g, ref in zip(main, _averaged([g.to(torch.bfloat16) for g in grads]), strict=True):
        assert g.dtype == torch.float32 and torch.equal(g.double(), ref)
    one, _, _, _ = _setup(monkeypatch, dtype=torch.bfloat16, mesh=_mesh(dp=1))
    assert one.flat_grads == []
    pure, _, _, _ = _setup(monkeypatch)
    assert pure.flat_grads == []


def test_expert_gradients_are_summed_over_their_replicas_and_divided_by_dp(monkeypatch) -> None:
    """Kills: experts reduced over the DP group (or with the dense gradients), the
    expert index computed from the wrong names, an expert group of one rank still
    all-reduced. dp 2, edp 2: both groups reduce; edp 1: the expert's sum is its own."""
    sync, fake, named, grads = _setup(monkeypatch, experts=("b",))
    assert sync.expert_index == [1]
    sync.average_dp()
    assert sorted((c["numel"], c["group"]) for c in fake.calls) == [
        (2, "edp group"), (7, "dp group")]
    for (_, p), ref in zip(named, _averaged(grads), strict=True):
        assert torch.equal(p.grad, ref)
    lone, fake_lone, named_lone, _ = _setup(monkeypatch, experts=("b",), mesh=_mesh(edp=1))
    lone.average_dp([1])
    assert fake_lone.calls == []
    assert torch.equal(named_lone[1][1].grad, grads[1].double() / 2)  # its own sum, / dp


def test_the_shared_sum_gets_the_gradients_it_names(monkeypatch) -> None:
    """Kills: the shared sum skipped, handed the wrong names or copies (its in-place
    sum then lost), and `names` ignored (every gradient handed when it names some)."""
    seen: dict = {}

    def shared(grads: dict[str, torch.Tensor]) -> None:
        seen.update(grads)
        for g in grads.values():
            g.add_(100.0)

    shared_names = SimpleNamespace(names={"c"})
    sync, _, named, grads = _setup(monkeypatch, shared=shared)
    sync.sum_shared()
    assert sorted(seen) == ["a", "b", "c"]
    assert torch.equal(named[0][1].grad, grads[0].double() + 100)

    class _Named:
        names = shared_names.names

        def __call__(self, grads: dict[str, torch.Tensor]) -> None:
            shared(grads)

    seen.clear()
    sync, _, named, grads = _setup(monkeypatch, shared=_Named())
    sync.sum_shared()
    assert sorted(seen) == ["c"]
    assert torch.equal(named[0][1].grad, grads[0].double())


def test_every_rank_counts_its_own_and_the_lowest_counts_a_shared_key(monkeypatch) -> None:
    """Kills: the keys not gathered at world size > 1 (every replica would count the
    same gradients), a gather at world size 1, and the mask not made of the norm keys."""
    sync, _, _, _ = _setup(monkeypatch)
    assert sync.counted == [True, True, True]  # rank 0 is the lowest holding them
    mesh = _mesh()
    mesh.rank = 1
    other, _, _, _ = _setup(monkeypatch, mesh=mesh)
    assert other.counted == [False, False, False]
    one, _, _, _ = _setup(monkeypatch, mesh=_mesh(dp=1))
    assert one.counted == [True, True, True]
    assert one.grad_norm() == pytest.approx(math.sqrt(1 + 4 + 9 + 16 + 25 + 36 + 49 + 64 + 81))


def test_a_backend_error_is_one_rank_error_naming_the_collective() -> None:
    """Kills: the backend error passed through raw, a RankError wrapped twice, the
    action or peers left out of the message."""
    mesh = _mesh()

    def lost() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(PeerLost) as err:
        collective(mesh, "DP gradient all-reduce", "a rank in the dp group", lost)
    assert str(err.value).startswith("rank 0 (pp 0, tp 0, dp 0) in DP gradient all-reduce: "
                                     "a rank in the dp group closed the connection")
    mine = RankError("already one", where="w", action="a")

    def raises_rank_error() -> None:
        raise mine

    with pytest.raises(RankError) as again:
        collective(mesh, "x", WORLD, raises_rank_error)
    assert again.value is mine
    assert collective(mesh, "x", WORLD, lambda a, *, b: a + b, 1, b=2) == 3


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def reduction(self, work, name, kind, stage, launched):  # noqa: ANN001
        self.seen.append((name, kind, stage))
        return None


def test_the_trace_names_each_reduction_by_stage(monkeypatch) -> None:
    """Kills: the recorder skipped, the name or kind changed, what is left attributed
    to the wrong stage (the lowest stage's index is what the trace draws it at)."""
    sync, _, _, _ = _setup(monkeypatch, overlap=True)
    sync.recorder = _Recorder()
    sync.stage_final(1)
    sync.after_backward({}, 1, 1.0)
    assert sync.recorder.seen == [("DP-AR stage 1", "DP-AR", 1), ("DP-AR left", "DP-AR", 0)]


def test_views_of_a_flat_buffer() -> None:
    """Kills: _views_of accepting a copy, a gap, another dtype, a non-contiguous view
    or views that do not fill the buffer (each check inverted or dropped)."""
    flat = torch.zeros(6)
    a, b = flat[:2], flat[2:6].view(2, 2)
    assert _views_of(flat, [a, b])
    assert not _views_of(flat, [a])  # does not fill it
    assert not _views_of(flat, [b, a])  # out of order
    assert not _views_of(flat, [a.clone(), b])
    assert not _views_of(flat, [a, b.t()])
    assert not _views_of(flat.double(), [a.double(), b.double()])
    other = torch.zeros(6, dtype=torch.float64)
    assert not _views_of(flat, [other[:2].float(), b])
    assert _views_of(torch.zeros(0), [])


def test_stage_params_are_consecutive_in_stage_order() -> None:
    """Kills: offsets not advanced, a stage's count off by one, the count check dropped."""
    p = [nn.Parameter(torch.zeros(1)) for _ in range(3)]
    stages = {4: _Stage((), x=p[0], y=p[1]), 2: _Stage((), z=p[2])}
    assert _stage_params(stages, 3) == {4: [0, 1], 2: [2]}
    with pytest.raises(AssertionError, match="3 stage parameters, 4 in the precision"):
        _stage_params(stages, 4)


def test_the_loss_sum_is_float64_on_this_ranks_device(monkeypatch) -> None:
    """Kills: the microbatch losses summed in float32 (2^24 + 1 is 2^24 there), the
    sum or the total made on the default device instead of this rank's (here torch's
    meta device, so a CPU tensor shows)."""
    sync, _, _, _ = _setup(monkeypatch)
    f64 = torch.float64
    losses = {0: torch.tensor(2.0 ** 24, dtype=f64), 1: torch.tensor(1.0, dtype=f64)}
    assert sync.world_loss(losses, 1, 1.0) == (2.0 ** 24 + 1) / 2 + OTHER
    sync.device = torch.device("meta")
    total = sync.world_loss_tensor({0: torch.tensor(1.0, device="meta")}, 1, 1.0)
    assert total.device.type == "meta" and total.dtype == f64


def test_a_lost_peer_in_the_loss_sum_is_named(monkeypatch) -> None:
    """Kills: the loss all-reduce's default action name changed, or the action or the
    peers dropped from the rank error a lost peer raises."""
    sync, fake, _, _ = _setup(monkeypatch)

    def lost(*args, **kw) -> None:  # noqa: ANN002, ANN003
        raise RuntimeError("Connection closed by peer")

    fake.all_reduce = lost
    with pytest.raises(PeerLost) as err:
        sync.after_backward({}, 1, 1.0)  # world_loss_tensor with its default action
    assert str(err.value).startswith("rank 0 (pp 0, tp 0, dp 0) in loss all-reduce: "
                                     "a rank in the world closed the connection")
