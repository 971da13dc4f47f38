"""stp.train.step.lr: the cases tests/train/test_lr.py never set up.

Written to kill mutants mutmut left alive in stp/train/step/lr.py (docs/testing.md).
The reference is the schedule's formula worked by hand (module docstring of
stp.train.step.lr) and torch's own AdamW. Each test names the bug it guards against.
"""

from __future__ import annotations

import math

import pytest
import torch

from stp.train.step.lr import LRSchedule, adamw, make_scheduler


def _by_hand(step: int, base: float, total: int, warmup: int, min_lr: float) -> float:
    """Warm-up from base/warmup, then cosine from base to min_lr over total - warmup."""
    if step < warmup:
        return base * (step + 1) / warmup
    p = min(1.0, (step - warmup) / (total - warmup))
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * p)) / 2


def _opt(lr: float) -> torch.optim.Optimizer:
    return adamw(lr)([torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))])


def _step(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> float:
    """The lr this update runs at, then the update and the scheduler's step."""
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    return lr


def _two_groups() -> torch.optim.Optimizer:
    """AdamW with a base of 1.0 and a second group at a base of 0.5."""
    opt = adamw(1.0)([torch.nn.Parameter(torch.ones(2, 2))])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, 3))], "lr": 0.5})
    return opt


SCHEDULE = LRSchedule("cosine", total_steps=8, warmup=4, min_lr=0.3)


def _check_steps(opt: torch.optim.Optimizer, sched, first: int, last: int) -> None:
    """Steps first..last run at the formula's lr, in both groups."""
    for step in range(first, last + 1):
        lrs = [g["lr"] for g in opt.param_groups]
        _step(opt, sched)
        assert lrs[0] == pytest.approx(_by_hand(step, 1.0, 8, 4, 0.3), rel=1e-12), step
        assert lrs[1] == pytest.approx(_by_hand(step, 0.5, 8, 4, 0.3), rel=1e-12), step


def test_a_resumed_schedule_gives_the_formulas_lr_every_step() -> None:
    """Kills: the factor lr * base instead of lr / base (the second group's base is
    0.5). Resumed as stp.train.checkpoint.sharded does (scheduler built on a fresh optimizer,
    then the optimizer's state, then the scheduler's) during the warm-up, 9 steps
    before the end, with the lr checked on every step."""
    first = _two_groups()
    sched = make_scheduler(first, SCHEDULE)
    _check_steps(first, sched, 0, 0)
    again = _two_groups()
    resumed = make_scheduler(again, SCHEDULE)
    again.load_state_dict(first.state_dict())
    resumed.load_state_dict(sched.state_dict())
    _check_steps(again, resumed, 1, 9)


def test_the_base_is_the_groups_initial_lr() -> None:
    """Kills: the base read from the group's current lr instead of its initial_lr,
    in the min_lr check and in the factors. An optimizer restored before its scheduler
    is built carries initial_lr (0.5) and a warm-up lr (0.25, under min_lr 0.3): the
    check must pass and the factors be relative to 0.5. The first step after building
    runs at LambdaLR's own reset value (factor of step 0), so the check starts at step 2."""
    first = _two_groups()
    sched = make_scheduler(first, SCHEDULE)
    _check_steps(first, sched, 0, 0)
    again = _two_groups()
    again.load_state_dict(first.state_dict())
    assert again.param_groups[1]["lr"] == pytest.approx(0.25)
    resumed = make_scheduler(again, SCHEDULE)
    resumed.load_state_dict(sched.state_dict())
    _step(again, resumed)
    _check_steps(again, resumed, 2, 9)
    with pytest.raises(ValueError):  # every group is checked: 0.6 is above the second's 0.5
        make_scheduler(_two_groups(), LRSchedule("cosine", total_steps=8, min_lr=0.6))


def test_min_lr_at_the_base_and_a_constant_schedule_are_accepted() -> None:
    """Kills: `min_lr >= base` refused (min_lr == lr is a flat schedule) and the
    constant schedule checked too (it never reaches min_lr)."""
    opt = _opt(1e-3)
    make_scheduler(opt, LRSchedule("cosine", total_steps=4, min_lr=1e-3))
    make_scheduler(_opt(1e-3), LRSchedule("constant", min_lr=1e-2))
    with pytest.raises(ValueError, match=r"^min_lr 0\.01 is above the learning rate 0\.001; "
                                         r"give a min_lr <= lr$"):
        make_scheduler(_opt(1e-3), LRSchedule("linear", total_steps=4, min_lr=1e-2))


def test_a_group_at_lr_zero_stays_at_zero() -> None:
    """Kills: the `base > 0` guard dropped or made `>= 0` (a division by zero)."""
    opt = _opt(1e-3)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, 3))], "lr": 0.0})
    sched = make_scheduler(opt, LRSchedule("cosine", total_steps=4, warmup=1))
    for _ in range(3):
        assert opt.param_groups[-1]["lr"] == 0.0
        _step(opt, sched)


def test_adamw_is_torchs_with_the_documented_defaults() -> None:
    """Kills: the defaults changed (weight decay 0, betas (0.9, 0.95), eps 1e-8) or not
    passed on, and weight decay not given to the matrices' group. Two steps against
    torch.optim.AdamW."""
    torch.manual_seed(0)
    w, b = torch.randn(3, 3), torch.randn(3)
    grads = [(torch.randn(3, 3), torch.randn(3)) for _ in range(2)]
    for wd, kw in ((0.0, {}), (0.1, {"weight_decay": 0.1})):
        ours = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
        theirs = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
        opt = adamw(1e-2, **kw)(ours)
        ref = torch.optim.AdamW([{"params": theirs[:1], "weight_decay": wd},
                                 {"params": theirs[1:], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        assert [g["weight_decay"] for g in opt.param_groups] == [wd, 0.0]
        assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in opt.param_groups)
        for gw, gb in grads:
            for params, o in ((ours, opt), (theirs, ref)):
                params[0].grad, params[1].grad = gw.clone(), gb.clone()
                o.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))


def test_adamw_passes_on_its_betas_and_eps() -> None:
    """Kills: betas or eps not passed to torch.optim.AdamW (its defaults, (0.9, 0.999)
    and 1e-8, would run instead; 1e-8 is also stp's default, so only a caller's eps
    shows the bug)."""
    opt = adamw(1e-2, betas=(0.8, 0.9), eps=1e-6)([torch.nn.Parameter(torch.ones(2, 2))])
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["eps"] == 1e-6


@pytest.mark.parametrize("lr,wd,message", [
    (0.0, 0.0, r"^lr must be > 0, got 0\.0$"),
    (-1.0, 0.0, r"^lr must be > 0, got -1\.0$"),
    (1.0, -0.1, r"^weight_decay must be >= 0, got -0\.1$"),
])
def test_bad_optimizer_settings_name_the_value(lr: float, wd: float, message: str) -> None:
    """Kills: lr 0 accepted (`lr >= 0`), and the messages lost."""
    with pytest.raises(ValueError, match=message):
        adamw(lr, weight_decay=wd)


@pytest.mark.parametrize("kw,message", [
    ({"kind": "step"},
     r"^lr schedule 'step' not accepted; choose one of constant, cosine, linear$"),
    ({"warmup": -1}, r"^warmup \(-1\) and total_steps \(0\) must be >= 0$"),
    ({"min_lr": float("inf")}, r"^min_lr must be a finite number >= 0, got inf$"),
    ({"min_lr": -0.5}, r"^min_lr must be a finite number >= 0, got -0\.5$"),
])
def test_bad_schedules_name_the_value_and_what_is_accepted(kw, message) -> None:
    """Kills: the messages lost or garbled, and `finite and >= 0` weakened to `or` (an
    infinite or a negative min_lr accepted)."""
    with pytest.raises(ValueError, match=message):
        LRSchedule(**kw)


def test_a_one_step_decay_reaches_min_lr_at_its_end() -> None:
    """Kills: the decay span floored at 2 instead of 1 (a one-update decay would stop
    halfway). By hand: linear from 1.0 to 0.2 over total_steps - warmup = 1 update."""
    s = LRSchedule("linear", total_steps=3, warmup=2, min_lr=0.2)
    assert [s.lr(k, 1.0) for k in range(5)] == [0.5, 1.0, 1.0, pytest.approx(0.2),
                                                 pytest.approx(0.2)]
