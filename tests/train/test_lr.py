"""Learning-rate schedules and AdamW parameter groups (pure, one process)."""

from __future__ import annotations

import math

import pytest
import torch

from stp.train.step.lr import LRSchedule, adamw, make_scheduler, param_groups


def test_warmup_then_cosine_reaches_min_lr_at_total_steps() -> None:
    s = LRSchedule("cosine", total_steps=10, warmup=2, min_lr=0.1)
    assert [s.lr(k, 1.0) for k in (0, 1)] == [0.5, 1.0]
    assert s.lr(2, 1.0) == 1.0  # the decay starts at the base
    assert s.lr(6, 1.0) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr(10, 1.0) == pytest.approx(0.1) and s.lr(50, 1.0) == pytest.approx(0.1)


def test_linear_and_constant() -> None:
    lin = LRSchedule("linear", total_steps=4, min_lr=0.0)
    assert [lin.lr(k, 2.0) for k in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    const = LRSchedule("constant", warmup=4)
    assert [const.lr(k, 1.0) for k in (0, 3, 100)] == [0.25, 1.0, 1.0]


def test_scheduler_sets_the_lr_of_every_group_and_counts_updates() -> None:
    w, g = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = adamw(1.0, weight_decay=0.1)([w, g])
    sched = make_scheduler(opt, LRSchedule("linear", total_steps=4, warmup=1))
    seen = []
    for _ in range(3):
        seen.append([grp["lr"] for grp in opt.param_groups])
        opt.step()
        sched.step()
    assert seen == [[1.0, 1.0], [1.0, 1.0], [pytest.approx(2 / 3)] * 2]


def test_no_weight_decay_on_norms_and_biases() -> None:
    matrix, gain = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3))
    groups = param_groups([matrix, gain], 0.1)
    assert [(len(grp["params"]), grp["weight_decay"]) for grp in groups] == [(1, 0.1), (1, 0.0)]
    assert groups[1]["params"][0] is gain


@pytest.mark.parametrize("kw,message", [
    ({"kind": "step"}, "lr schedule 'step' not accepted"),
    ({"warmup": -1}, "must be >= 0"),
    ({"min_lr": float("nan")}, "min_lr must be a finite number"),
])
def test_bad_schedules_are_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        LRSchedule(**kw)


def test_min_lr_above_the_lr_is_refused() -> None:
    opt = adamw(1e-3)([torch.nn.Parameter(torch.ones(2, 2))])
    with pytest.raises(ValueError, match="min_lr 0.01 is above the learning rate 0.001"):
        make_scheduler(opt, LRSchedule("cosine", total_steps=5, min_lr=1e-2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_is_fused_and_steps_as_torchs_loop_even_on_a_transposed_gradient(dtype) -> None:
    """stp train's AdamW is torch's fused kernel (one call per step, no read of each
    step count); its updates are torch's single-tensor AdamW's within an ulp, also for
    a gradient that is a transposed view (which the fused CPU kernel alone misreads)."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(6, 4, generator=gen, dtype=dtype), torch.randn(5, dtype=dtype,
                                                                       generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = adamw(0.1, weight_decay=0.1)(ours)
    assert all(g.get("fused") for g in opt.param_groups)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=0.1, betas=(0.9, 0.95), eps=1e-8,
                                foreach=False)
    for _ in range(3):
        grads = [torch.randn(4, 6, generator=gen, dtype=dtype).t(),
                 torch.randn(5, generator=gen, dtype=dtype)]
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g, g.contiguous()
        opt.step()
        ref_opt.step()
    tol = {torch.float32: 1e-6, torch.float64: 1e-14}[dtype]
    for p, q in zip(ours, ref, strict=True):
        assert torch.allclose(p, q, rtol=tol, atol=tol), (p - q).abs().max()
