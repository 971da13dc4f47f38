"""The runtime's slice of a run's settings (stp.runtime.executor_options): an
Executor takes one ExecutorOptions record or its fields as typed keywords, never
both, and the record refuses a value it cannot run with."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from test_executor_toy import ToyStage

from stp.runtime.executor import Executor, ExecutorOptions
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule


def _one_rank() -> tuple:
    sch = make_schedule("1f1b", 1, 2)
    return lower(sch), 0, {0: ToyStage(0, 1, 2)}, None


def test_keywords_are_the_options_fields_with_their_defaults():
    params = inspect.signature(Executor.__init__).parameters
    for f in dataclasses.fields(ExecutorOptions):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY, f.name
        assert params[f.name].default == f.default, f.name


def test_keywords_make_the_record_the_executor_runs_with():
    ex = Executor(*_one_rank(), boundary_shape=[2, 3, 4], dtype=torch.float64, braid=False,
                  where="rank 0")
    want = ExecutorOptions((2, 3, 4), torch.float64, "cpu", "rank 0", "", False)
    assert ex.options == want and ex.boundary_shape == (2, 3, 4)
    assert ex.dtype is torch.float64 and ex.where == "rank 0"
    again = Executor(*_one_rank(), want)
    assert again.options is want


def test_a_record_and_keywords_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        Executor(*_one_rank(), ExecutorOptions(), braid=False)


@pytest.mark.parametrize("shape", [(), (1, 0, 4), (1, -2), (1.5, 2)])
def test_a_boundary_shape_of_no_tensor_is_refused(shape):
    with pytest.raises(ValueError, match="boundary_shape must be positive integers"):
        ExecutorOptions(boundary_shape=shape)


def test_braid_must_be_a_bool():
    with pytest.raises(ValueError, match="braid must be True or False"):
        ExecutorOptions(braid="off")
