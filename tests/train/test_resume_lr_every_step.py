"""A resumed run's learning rate, checked on every step against torch's own
schedulers, and its losses against the uninterrupted run.

Guards against a checkpoint that restores the optimizer but not the LR
scheduler's position (stp.train.checkpoint.sharded.load): the optimizer's param groups
carry the learning rate of the next update, so the first step after a resume
is right either way -- where the other fast resume tests stop -- and the
scheduler, restarted at update 0, is wrong from the second. Here the resumed
run goes on for three or more updates, in the warm-up (cosine) and in the decay
(linear).

One process, float64, AdamW, clipping active. Reference learning rates: torch's
LinearLR warm-up followed by CosineAnnealingLR or by a second LinearLR to
min_lr, chained by SequentialLR, on a throwaway optimizer (not
stp.train.step.lr.make_scheduler, which is what is under test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _train_common import CONFIG, LR, optimizer, options, train
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from stp.train.step.lr import LRSchedule
from stp.train.step.trainer import Trainer

TOTAL, WARMUP, MIN_LR = 6, 2, 1e-3
SAVED_AFTER = {"cosine": 1, "linear": 3}
"""Updates before the checkpoint: inside the warm-up (5 left), inside the decay (3 left)."""
MICROBATCHES = 2


def torch_lrs(kind: str) -> list[float]:
    """The learning rate of each of TOTAL updates, as torch's schedulers give it:
    warm-up from LR / WARMUP to LR over WARMUP updates, then decay to MIN_LR at TOTAL."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    warmup = LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    if kind == "cosine":
        decay = CosineAnnealingLR(opt, T_max=TOTAL - WARMUP, eta_min=MIN_LR)
    else:
        decay = LinearLR(opt, start_factor=1.0, end_factor=MIN_LR / LR,
                         total_iters=TOTAL - WARMUP)
    sched = SequentialLR(opt, [warmup, decay], milestones=[WARMUP])
    out = []
    for _ in range(TOTAL):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _trainer(schedule: LRSchedule, root: Path | None = None) -> Trainer:
    args = (CONFIG, optimizer(), "1f1b")
    kw = {"pp": 1, "microbatches": MICROBATCHES, **options(lr_schedule=schedule)}
    return Trainer(*args, **kw) if root is None else Trainer.resume(str(root), *args, **kw)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_resumed_lr_follows_torch_on_every_step_and_losses_match(kind: str,
                                                                  tmp_path: Path) -> None:
    """Bug guarded: the LR scheduler's state dropped (or misread) on resume."""
    schedule = LRSchedule(kind, total_steps=TOTAL, warmup=WARMUP, min_lr=MIN_LR)
    saved = SAVED_AFTER[kind]
    straight = _trainer(schedule)
    before = train(straight, range(saved))
    straight.save(str(tmp_path))
    after = train(straight, range(saved, TOTAL))

    resumed = _trainer(schedule, tmp_path)
    assert resumed.steps_done == saved
    again = train(resumed, range(saved, TOTAL))

    expected = torch_lrs(kind)
    lrs = [lr for _, _, lr in before + after]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0), (lrs, expected)
    for step, (_, _, lr) in zip(range(saved, TOTAL), again, strict=True):
        assert lr == pytest.approx(expected[step], rel=1e-12, abs=0), (
            f"{kind}: update {step} after resuming at {saved} ran at lr {lr!r}, "
            f"torch's scheduler gives {expected[step]!r}")
    # the same process, mesh and data: the resumed run repeats the straight one exactly
    assert [loss for loss, _, _ in again] == [loss for loss, _, _ in after]
    assert [norm for _, norm, _ in again] == [norm for _, norm, _ in after]
