"""Python's cyclic garbage collector paused while a training step runs.

A step allocates thousands of Python objects (autograd nodes' wrappers, the
runtime's per-action records), so the collector's young generation fills
several times a step and each pass walks every tracked object: pauses of
milliseconds at places that have nothing to do with the step's work. As in
torchtitan's `gc_freq`, the collector is off during a step and a collection of
the two young generations runs before every `every`-th step, where its cost is
at one known place; between steps the collector is as the caller had it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["StepGC", "gc_paused"]

T = TypeVar("T")


class StepGC:
    """Counts steps; `during_step()` wraps one (module doc)."""

    def __init__(self, every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"gc_every must be an int >= 1 (steps between collections), "
                             f"got {every!r}")
        self.every = every
        self.steps = 0
        self.collections = 0
        """Collections this object ran (for the tests and a curious user)."""

    @contextlib.contextmanager
    def during_step(self) -> Iterator[None]:
        self.steps += 1
        if self.steps % self.every == 0:
            gc.collect(1)
            self.collections += 1
        was_on = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was_on:
                gc.enable()


def gc_paused(step: Callable[..., T]) -> Callable[..., T]:
    """A method decorator: run the method as a step of `self.step_gc` (a StepGC)."""

    @functools.wraps(step)
    def run(self: Any, *args: Any, **kwargs: Any) -> T:
        with self.step_gc.during_step():
            return step(self, *args, **kwargs)

    return run
