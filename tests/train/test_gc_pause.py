"""Python's garbage collector is off during a training step and collects before every
gc_every-th step (stp.train.step.gc_pause; issue 35, torchtitan's gc_freq)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from stp.models import ModelConfig
from stp.train.run.parts import TrainerOptions
from stp.train.step.gc_pause import StepGC
from stp.train.step.trainer import Trainer


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def gc_state():
    was_on = gc.isenabled()
    yield
    (gc.enable if was_on else gc.disable)()


def test_collector_is_off_inside_a_step_and_restored_after(gc_state):
    pause = StepGC(every=100)
    for on in (True, False):
        (gc.enable if on else gc.disable)()
        with pause.during_step():
            assert not gc.isenabled()
        assert gc.isenabled() == on


def test_cycles_are_collected_before_every_nth_step_only(gc_state):
    """With the collector off outside the steps too, a cycle made in step 1 lives until
    the collection before step 3 frees it."""
    gc.disable()
    pause = StepGC(every=3)
    with pause.during_step():
        ref = weakref.ref(_Node())
    with pause.during_step():
        assert ref() is not None  # step 2: no collection
    assert ref() is not None
    with pause.during_step():
        assert ref() is None  # step 3: collected before it ran
    for _ in range(4):  # steps 4..7: one more, before step 6
        with pause.during_step():
            pass
    assert pause.collections == 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "50"])
def test_bad_gc_every_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"gc_every must be an int >= 1.*got"):
        TrainerOptions(gc_every=bad)


def test_trainer_step_runs_with_the_collector_off(gc_state, one_torch_thread):
    """What the step runs (here the optimizer's step) sees the collector off; after the
    step it is on again, and the Trainer counts its steps for the collections."""
    seen = []

    def optimizer(params):
        opt = torch.optim.SGD(params, lr=1e-3)
        opt.register_step_pre_hook(lambda *_: seen.append(gc.isenabled()))
        return opt

    config = ModelConfig(hidden=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         max_seq_len=8)
    trainer = Trainer(config, optimizer, "1f1b", microbatches=2, gc_every=2)
    gc.enable()
    ids = torch.randint(0, config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        trainer.step((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    assert seen == [False, False] and gc.isenabled()
    assert trainer.step_gc.steps == 2 and trainer.step_gc.collections == 1
