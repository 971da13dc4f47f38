"""The executor on a toy model of its own, independent of stp.models.

The toy is an embedding, a chain of residual tanh layers and a head with a
mean cross-entropy, cut into stages; it implements PipelineStage with a real
B/W split (B: autograd to the stage input only; W: autograd to the weights
only). Every schedule in the registry runs on 2 pipeline ranks in one spawn,
and the loss and every gradient must equal a single-process autograd run.
In the same spawn, broken variants: bugs planted in the executor (each
microbatch's loss given the next one's targets; the loss gradient not
scaled by 1 / m) must fail the same comparison.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from _dist import run_dist
from torch import nn

from stp.runtime.executor import Executor
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.runtime.trace import Recorder
from stp.schedule import registry
from stp.schedule.ir import passes_of
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule
from stp.train.step.trainer import Trainer

VOCAB, HIDDEN, SEQ, MBS = 11, 6, 5, 2


def _init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5


def _layers(num_layers: int, stage: int, num_stages: int) -> range:
    per = num_layers // num_stages
    return range(stage * per, (stage + 1) * per)


class ToyStage(nn.Module):
    """Stage `stage` of the toy; stores per-microbatch (input, output, grad)."""

    def __init__(self, stage: int, num_stages: int, num_layers: int) -> None:
        super().__init__()
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == num_stages - 1
        self.names = []
        if self.is_first:
            self.names.append("embed")
        self.names += [f"layer{i}" for i in _layers(num_layers, stage, num_stages)]
        if self.is_last:
            self.names.append("head")
        for n in self.names:
            shape = (VOCAB, HIDDEN) if n in ("embed", "head") else (HIDDEN, HIDDEN)
            self.register_parameter(n, nn.Parameter(_init(n, shape)))
        self.saved: dict[int, list] = {}

    def shard_dim(self, name: str) -> None:
        return None

    def _run(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        for n in self.names:
            w = getattr(self, n)
            if n == "embed":
                x = F.embedding(x, w)
            elif n == "head":
                x = F.cross_entropy((x @ w.T).flatten(0, 1), targets.flatten())
            else:
                x = x + torch.tanh(x @ w.T)
        return x

    def forward(self, mb, x, targets=None):
        if not self.is_first:
            x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = self._run(x, targets)
        self.saved[mb] = [x, out, None]
        return out.detach()

    def backward_input(self, mb, grad, scale=1.0):
        x, out, _ = self.saved[mb]
        g = torch.full_like(out, scale) if self.is_last else grad
        self.saved[mb][2] = g
        if self.is_first:
            return None
        (gx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
        return gx

    def backward_weight(self, mb):
        _, out, g = self.saved.pop(mb)
        torch.autograd.backward(out, g, inputs=list(self.parameters()))

    def backward_full(self, mb, grad, scale=1.0):
        gx = self.backward_input(mb, grad, scale)
        self.backward_weight(mb)
        return gx


def _reference(num_layers: int, tokens, targets):
    model = ToyStage(0, 1, num_layers)
    loss = model._run(tokens, targets)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def _batch(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, VOCAB, (m * MBS, SEQ + 1), generator=gen)
    return tok[:, :-1], tok[:, 1:]


def _actions_run(recorder: Recorder, actions) -> list[str]:
    """The compute actions the recorder saw, in run order, as schedule strings
    (the passes of action k carry action_index k)."""
    by_index: dict[int, list[str]] = {}
    for sp in sorted(recorder.spans(), key=lambda sp: sp.start):
        if sp.lane == "compute" and sp.name not in by_index.get(sp.action_index, []):
            by_index.setdefault(sp.action_index, []).append(sp.name)
    run = []
    for k in sorted(by_index):
        passes = [str(p) for p in passes_of(actions[k])]
        run.append(str(actions[k]) if sorted(by_index[k]) == sorted(passes) else "?")
    return run


def _next_targets(ex: Executor, m: int) -> None:
    ex.runner.targets = lambda mb: ex._targets[(mb + 1) % m]


def _unscaled(ex: Executor, m: int) -> None:
    plain = ex.run
    ex.run = lambda inputs, targets, scale=None, **kw: plain(inputs, targets, scale=1.0, **kw)


BUGS = {"broken: next microbatch's targets": _next_targets, "broken: loss not scaled by 1/m":
        _unscaled}
"""Bugs planted in one Executor (after it is built): name -> plant(executor, m)."""


def _run_all_schedules(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """pp = world: every schedule, toy stages, executor only (no Trainer); then
    1F1B again with each planted bug."""
    dims = ParallelDims(pp=world)
    mesh = Mesh.from_world(dims, timeout=30)
    out = {}
    runs = [(name, name, None) for name in registry.names()]
    runs += [(bug, "1f1b", plant) for bug, plant in BUGS.items()]
    for label, name, plant in runs:
        sch = make_schedule(name, world)
        m, num_layers = sch.num_microbatches, 2 * sch.num_stages
        stages = {s: ToyStage(s, sch.num_stages, num_layers) for s in sch.stages_of(rank)}
        p2p = P2P(mesh.pp_group, mesh.ranks["pp"], sch.num_stages, timeout=30, where=f"r{rank}")
        recorder = Recorder(rank, [sch.chunk_of(s) for s in range(sch.num_stages)])
        ex = Executor(lower(sch), rank, stages, p2p, boundary_shape=(MBS, SEQ, HIDDEN),
                      dtype=torch.float64, recorder=recorder)
        if plant is not None:
            plant(ex, m)
        tokens, targets = _batch(m)
        losses = ex.run(list(tokens.chunk(m)), list(targets.chunk(m)))
        # The trace lines up with the schedule action for action.
        assert _actions_run(recorder, sch.actions[rank]) == [str(a) for a in sch.actions[rank]]
        mine = {n: p.grad for st in stages.values() for n, p in st.named_parameters()}
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, (losses, mine))
        if rank == 0:
            all_losses = {k: v for ls, _ in gathered for k, v in ls.items()}
            grads = {k: v for _, g in gathered for k, v in g.items()}
            ref_loss, ref_grads = _reference(num_layers, tokens, targets)
            assert sorted(all_losses) == list(range(m))
            loss = sum(float(v) for v in all_losses.values()) / m
            worst = max(
                float((grads[n] - g).abs().max() / g.abs().max()) for n, g in ref_grads.items()
            )
            assert set(grads) == set(ref_grads)
            out[label] = (abs(loss - ref_loss) / abs(ref_loss), worst)
    # The Trainer over a stage builder, fed by an iterator: step() without a batch.
    m = 4
    tokens, targets = _batch(m, seed=5)
    trainer = Trainer(
        lambda s, n, **kw: ToyStage(s, n, 2 * n), lambda ps: torch.optim.SGD(ps, lr=0.1),
        "1f1b", mesh=mesh, microbatches=m, hidden=HIDDEN, dtype=torch.float64,
        data=iter([(tokens, targets)]),
    )
    out["trainer"] = (trainer.step(), _reference(4, tokens, targets)[0])
    with pytest.raises(StopIteration):
        trainer.step()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_dist(_run_all_schedules, 2, timeout=150)[0]


def test_every_schedule_matches_autograd_on_two_ranks(two_ranks: dict):
    res = {k: v for k, v in two_ranks.items() if k not in BUGS}
    loss, ref_loss = res.pop("trainer")
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert set(res) == set(registry.names())
    for name, (loss_err, grad_err) in res.items():
        assert loss_err <= 1e-12, (name, loss_err)
        assert grad_err <= 1e-9, (name, grad_err)


def test_planted_executor_bugs_fail_the_comparison(two_ranks: dict):
    for bug in BUGS:
        loss_err, grad_err = two_ranks[bug]
        assert loss_err > 1e-12 or grad_err > 1e-9, (bug, loss_err, grad_err)


def test_executor_refuses_wrong_stages():
    sch = make_schedule("zb-v", 2)
    with pytest.raises(ValueError, match="holds stages"):
        Executor(lower(sch), 0, {0: ToyStage(0, 4, 4)}, None, boundary_shape=(1, 1, 1),
                 dtype=torch.float64)
