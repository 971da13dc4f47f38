"""One run's settings, one record sliced where it is used: `stp train`'s flags are
resolved once into a Run, whose `trainer_options()` is the Trainer's slice; the
Trainer takes that record or its fields as typed keywords (never both), and what
it built is read from `trainer.parts`."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from stp.train import LRSchedule, Trainer, TrainerOptions, TrainJob
from stp.train.run.resolve import resolve


def test_trainer_keywords_are_the_options_fields_with_their_defaults():
    params = inspect.signature(Trainer.__init__).parameters
    for f in dataclasses.fields(TrainerOptions):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY, f.name
        assert params[f.name].default == f.default, f.name


def test_a_record_and_keywords_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        Trainer(None, options=TrainerOptions(), clip_grad=1.0)


def test_keyword_values_are_checked_as_the_record_checks_them():
    with pytest.raises(ValueError, match="clip_grad must be > 0"):
        Trainer(None, clip_grad=0.0)


def test_the_run_slices_its_flags_into_the_trainer_options():
    job = TrainJob(pp=1, tp=1, dtype="float64", timeout=30.0, clip_grad=0.5,
                   lr_schedule="cosine", steps=10, warmup=2, min_lr=1e-4, offload="stp",
                   braid=False, recompute="selective", overlap_grad_sync=False,
                   shard_optimizer=True, overlap_param_gather=True, eos_id=3,
                   document_mask=True, partition="1,3")
    opts = resolve(job).trainer_options()
    assert opts == TrainerOptions(
        dtype=torch.float64, timeout=30.0, hidden=64, offload="stp", braid=False,
        clip_grad=0.5, lr_schedule=LRSchedule("cosine", 10, 2, 1e-4), partition=(1, 3),
        shard_optimizer=True, recompute="selective", document_eos=3,
        overlap_grad_sync=False, overlap_param_gather=True)


def test_an_emulated_run_has_no_activations_to_offload_nor_a_partition():
    job = TrainJob(pp=2, offload="none", emulate="f=1,b=1,w=1", trace="t.json")
    opts = resolve(job).trainer_options()
    assert opts.offload is None and opts.partition is None and opts.trace
