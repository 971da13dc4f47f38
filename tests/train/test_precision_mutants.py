"""stp.train.step.precision in one process, against torch's AdamW on fp32 weights.

Written to kill mutants mutmut left alive in stp/train/step/precision.py
(docs/testing.md): the module's older tests check the bf16 run's loss drop in a
spawned rank (invisible to mutmut) and the main grad's fp32 sum. Each test names
the bug it guards against.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo  # noqa: F401  imported by the first optimizer step: 40 s a mutant here
from torch import nn

from stp.train.step.precision import Precision, UpdateStats, apply_update

BF16 = torch.bfloat16


def _weights(dtype: torch.dtype) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(5)
    return [("a", nn.Parameter(torch.randn(3, 4, generator=gen).to(dtype))),
            ("b", nn.Parameter(torch.randn(5, generator=gen).to(dtype)))]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]


class _Unit:
    """A unit as stp.models makes them: W adds a weight gradient, backward_finish another."""

    def __init__(self, w: nn.Parameter) -> None:
        self.w = w

    def weight(self, g: torch.Tensor) -> str:
        self.w.grad = g.to(self.w.dtype) if self.w.grad is None else self.w.grad + g.to(BF16)
        return "weight's result"

    def backward_finish(self, g: torch.Tensor) -> str:
        self.w.grad = g.to(self.w.dtype)  # not through weight(): its own fold is tested
        return "backward_finish's result"


class _Chunk:
    """A unit holding its parameters only through `weights()` (stp.models.decoder.chunk)."""

    def __init__(self, parts: list[nn.Parameter]) -> None:
        self.parts = list(parts)  # a list attribute: not a tensor vars() would show

    def weights(self) -> list[nn.Parameter]:
        return self.parts

    def weight(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.parts, grads, strict=True):
            p.grad = g.to(p.dtype)


def test_two_mixed_precision_steps_are_torchs_adamw_on_fp32_masters() -> None:
    """Kills: masters not copied from the model (zeros, or left in bf16), main grads not
    zeroed between steps, the optimizer stepping the bf16 model, the schedule not
    stepped, the masters not rounded back into the model, clipping skipped or applied
    to a copy. Reference: torch.optim.AdamW on fp32 copies, torch's clip_grad_norm_,
    LambdaLR, the bf16 model the masters rounded."""
    named = _weights(BF16)
    prec = Precision(named, [_Unit(p) for _, p in named])
    assert prec.mixed and all(m.dtype == torch.float32 for m in prec.params)
    ref = [nn.Parameter(p.detach().float().clone()) for _, p in named]
    assert all(torch.equal(m, r) for m, r in zip(prec.params, ref, strict=True))

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    opt = torch.optim.AdamW(prec.params, lr=0.1, foreach=False)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, foreach=False)
    sched, ref_sched = schedule(opt), schedule(ref_opt)
    for step in range(2):
        prec.zero_grad()
        ref_opt.zero_grad()
        for (_, p), g, r in zip(named, _grads(step), ref, strict=True):
            p.grad = g.to(BF16)
            r.grad = g.to(BF16).float()
        prec.fold()
        norm = float(torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=False))
        stats = apply_update(prec, opt, sched, norm, 0.5)
        ref_opt.step()
        ref_sched.step()
        assert stats == UpdateStats(norm, 0.1 / (1 + step), skipped=False)
        for (_, p), m, r in zip(named, prec.params, ref, strict=True):
            assert torch.allclose(m, r, rtol=0, atol=1e-6), step
            assert p.dtype == BF16 and torch.equal(p, m.to(BF16))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


def test_a_pure_model_is_stepped_in_place_and_never_copied() -> None:
    """Kills: `mixed` true for float32 (masters made, the model never stepped), the
    fold / zero_grad / copy_to_model / grouping acting on a pure model, the names
    not kept (checkpoints and the DP reduction read them)."""
    named = _weights(torch.float32)
    prec = Precision(named, [_Unit(p) for _, p in named])
    assert not prec.mixed and prec.names == ["a", "b"]
    assert all(m is p for m, (_, p) in zip(prec.params, named, strict=True))
    g = torch.ones(3, 4)
    named[0][1].grad = g
    prec.fold()
    prec.zero_grad()
    assert named[0][1].grad is g and torch.equal(g, torch.ones(3, 4))
    assert prec.group_main_grads([[0, 1]]) == []
    before = [p.detach().clone() for _, p in named]
    prec.copy_to_model()
    assert all(torch.equal(p, b) for (_, p), b in zip(named, before, strict=True))
    # float16 is a low precision too
    assert Precision([("h", nn.Parameter(torch.zeros(2, dtype=torch.float16)))]).mixed


def test_w_and_backward_finish_fold_into_the_main_grad_of_their_own_parameters() -> None:
    """Kills: the fold wrapped around neither / only one of the two methods (a misspelt
    name), a wrapped method whose result or keyword arguments are lost, the fold of
    the wrong parameters, a fold that keeps the model's .grad (counted twice at the
    final fold), and `weights()` not asked."""
    named = _weights(BF16)
    chunk_param = nn.Parameter(torch.zeros(2, dtype=BF16))
    named.append(("c", chunk_param))
    unit_a, unit_b = _Unit(named[0][1]), _Unit(named[1][1])
    chunk = _Chunk([chunk_param])
    prec = Precision(named, [unit_a, unit_b, chunk, _Unit(nn.Parameter(torch.zeros(1)))])
    assert unit_a.weight(g=torch.full((3, 4), 0.5)) == "weight's result"
    assert unit_b.backward_finish(g=torch.full((5,), 0.25)) == "backward_finish's result"
    chunk.weight([torch.full((2,), 2.0)])
    assert all(p.grad is None for _, p in named)
    prec.fold()  # nothing left: nothing added twice
    main = prec.grads()
    assert torch.equal(main[0], torch.full((3, 4), 0.5))
    assert torch.equal(main[1], torch.full((5,), 0.25))
    assert torch.equal(main[2], torch.full((2,), 2.0))
    assert all(g.dtype == torch.float32 for g in main)


def test_fold_of_some_indices_leaves_the_others_and_zero_grad_zeroes_all() -> None:
    """Kills: fold(indices) folding every parameter (or none), `p.grad is not None`
    inverted, zero_grad skipping a main grad."""
    named = _weights(BF16)
    prec = Precision(named)
    for (_, p), g in zip(named, _grads(0), strict=True):
        p.grad = g.to(BF16)
    prec.fold([1])
    assert named[0][1].grad is not None and named[1][1].grad is None
    assert torch.equal(prec.grads()[0], torch.zeros(3, 4))
    assert torch.equal(prec.grads()[1], _grads(0)[1].to(BF16).float())
    prec.fold([0])
    assert torch.equal(prec.grads()[0], _grads(0)[0].to(BF16).float())
    prec.zero_grad()
    assert all(float(g.abs().sum()) == 0.0 for g in prec.grads())


def test_grouped_main_grads_are_views_of_one_flat_buffer_per_group_in_order() -> None:
    """Kills: a buffer of the wrong size or dtype, offsets not advanced (every view at
    0), the gradients not copied in, the main grad left a separate tensor (a reduction
    of the buffer would then not reach it), the group's order ignored."""
    named = _weights(BF16) + [("c", nn.Parameter(torch.zeros(2, dtype=BF16)))]
    prec = Precision(named)
    for (_, p), g in zip(named, [*_grads(1), torch.tensor([7.0, 8.0])], strict=True):
        p.grad = g.to(BF16)
    prec.fold()
    before = [g.clone() for g in prec.grads()]
    flat_b_a, flat_c = prec.group_main_grads([[1, 0], [2]])
    assert flat_b_a.dtype == torch.float32 and flat_b_a.shape == (5 + 12,)
    assert torch.equal(flat_b_a, torch.cat([before[1], before[0].flatten()]))
    assert torch.equal(flat_c, before[2])
    flat_b_a.mul_(2)  # what an in-place DP reduction does
    assert torch.equal(prec.grads()[0], 2 * before[0])
    assert torch.equal(prec.grads()[1], 2 * before[1])
    assert prec.full_grads() == prec.grads() and prec.grad_buffers() == prec.grads()
    assert prec.full_grads([2, 0]) == [prec.grads()[2], prec.grads()[0]]


def test_a_missing_gradient_is_created_as_zeros() -> None:
    """Kills: grads() returning None for a parameter without one, or a non-zero start."""
    named = _weights(torch.float32)
    prec = Precision(named)
    grads = prec.grads()
    assert [g.shape for g in grads] == [(3, 4), (5,)]
    assert all(float(g.abs().sum()) == 0.0 for g in grads)
    assert all(p.grad is g for (_, p), g in zip(named, grads, strict=True))
    assert prec.norm_keys(["k1", "k2"]) == ["k1", "k2"]
    assert prec.optimizer_box(1, "box") == "box"


class _Recorder(torch.optim.SGD):
    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, lr=1.0)
        self.steps = 0

    def step(self, closure=None):  # type: ignore[override]
        self.steps += 1
        return super().step(closure)


@pytest.mark.parametrize("norm", [math.inf, -math.inf, math.nan])
def test_a_non_finite_norm_skips_the_step_the_schedule_and_the_copy(norm: float) -> None:
    """Kills: `isfinite` inverted or dropped, the skip reported as a step, the lr read
    after the schedule stepped, a copy made on a skipped step."""
    named = _weights(BF16)
    prec = Precision(named)
    opt = _Recorder(prec.params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    copies: list[int] = []
    stats = apply_update(prec, opt, sched, norm, 1.0, lambda: copies.append(1))
    assert stats.skipped and stats.lr == 1.0
    assert stats.grad_norm == norm or (math.isnan(norm) and math.isnan(stats.grad_norm))
    assert opt.steps == 0 and sched.last_epoch == 0 and copies == []


def test_no_limit_no_clipping_and_the_given_copy_replaces_the_rounding() -> None:
    """Kills: clipping when max_norm is None, the coefficient's arguments swapped, the
    copy_to_model override ignored (or both run), no scheduler refused."""
    named = _weights(BF16)
    prec = Precision(named)
    for g in prec.grads():
        g.fill_(3.0)
    opt = _Recorder(prec.params)
    copies: list[int] = []
    model_before = [p.detach().clone() for _, p in named]
    stats = apply_update(prec, opt, None, 100.0, None, lambda: copies.append(1))
    assert stats == UpdateStats(100.0, 1.0, skipped=False)
    assert all(torch.equal(g, torch.full_like(g, 3.0)) for g in prec.grads())
    assert opt.steps == 1 and copies == [1]
    assert all(torch.equal(p, b) for (_, p), b in zip(named, model_before, strict=True))
    apply_update(prec, opt, None, 30.0, 3.0)  # coefficient 3 / (30 + 1e-6)
    assert all(torch.allclose(g, torch.full_like(g, 0.3), rtol=1e-6) for g in prec.grads())
    assert all(torch.equal(p, m.to(BF16)) for (_, p), m in zip(named, prec.params, strict=True))
