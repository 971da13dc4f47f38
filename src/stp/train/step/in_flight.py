"""A gradient collective in flight: launched with `async_op=True`, finished later.

The DP gradient reductions of a step are launched stage by stage while the
pipeline still computes (stp.train.step.grad_sync) and finished together before the
step's remaining collectives. What finishing one takes is the same for the
all-reduce and the sharded optimizer's reduce-scatter: wait for the work
(a backend error raised as the rank error `stp.train.step.grad_sync.collective`
makes, naming the action and the group), then use its result (divide by dp,
copy it where the gradients live).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["InFlight"]


@dataclass
class InFlight:
    """One launched collective and what its result needs once it is complete."""

    work: Any
    """The torch.distributed work (None: already complete, e.g. a group of one)."""
    wait: Callable[[], None]
    """Waits for `work`, a backend error raised as the rank error it is."""
    then: Callable[[], None]
    """Uses the result: the division by dp and the copy back."""
    launched: float = field(default_factory=time.perf_counter)
    keep: tuple[Any, ...] = ()
    """Buffers the backend reads or writes until the work completes."""
    watched: Any = None
    """The trace's record of it (stp.runtime.trace.Watched), stamped when waited for."""

    def completed(self) -> bool:
        """The work is done (finishing it will not wait)."""
        return self.work is None or bool(self.work.is_completed())

    def finish(self) -> None:
        """Wait for the work, then use its result. Call once."""
        if self.work is not None:
            self.wait()
        if self.watched is not None:
            self.watched.done(time.perf_counter())
        self.then()
        self.keep = ()
