"""Collectives launched from a communication thread: the compute stream only enqueues.

A collective's launch runs on the compute stream, so the braid cannot hide it
(stp.runtime.braid counts it as exposed). On a CPU host the launch costs far more
than its Python suggests: the process group's call wakes its worker thread, and
after a unit of compute (or an emulated unit's sleep) the call's code is cold;
measured on a loaded 2-core VM (benchmarks/results/moe_overlap.md), an
all-to-all launched by the compute thread right after 6 ms of emulated compute
took 190-250 us (median), handed to this thread 37-42 us, and the wait 3 ms
later was the same:

    compute:  unit F(i) |enqueue| unit B(j) .................... | wait | ...
    comm:                [launch A2A F(i)]
    EP group:                    [all-to-all F(i) ........]

One thread per process launches, in the order they were enqueued, every
collective of the groups that use it (the expert-parallel group: the token
exchanges and the counts exchange before a dispatch), so every rank of a
group still issues its collectives in the same order. c10d's bindings release
the GIL in the call, and torch's operators release it while they run, so the
thread runs beside the compute.

Only for CPU tensors (gloo): CUDA's current device and stream are per thread, and
a NCCL launch is cheap and asynchronous already; `launch` calls a CUDA
collective on the caller's thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Pending", "launch"]


class Pending:
    """A collective handed to the communication thread: a work-like handle
    (`wait`, `is_completed`) for stp.runtime.braid."""

    __slots__ = ("_start", "_launched", "_work", "_error")

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start: Callable[[], Any] | None = start
        self._launched = threading.Event()
        self._work: Any = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        start, self._start = self._start, None  # what it closes over goes with the run
        try:
            if start is None:
                raise RuntimeError("a Pending collective was run twice")
            self._work = start()
        except BaseException as e:  # handed to the waiter, never lost in the thread
            self._error = e
        finally:
            self._launched.set()

    def _launched_work(self) -> Any:
        self._launched.wait()
        if self._error is not None:
            raise self._error
        return self._work

    def wait(self) -> bool:
        """Block until the collective has been launched and has completed."""
        return self._launched_work().wait()

    def is_completed(self) -> bool:
        """False after a failed launch too: the runner then waits, and `wait` raises."""
        return (self._launched.is_set() and self._error is None
                and self._work.is_completed())


class _Thread:
    """The process's communication thread (started on first use, a daemon)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has no thread: it starts its own
        self.queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="stp-comm", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.queue.get()._run()


_THREAD: _Thread | None = None
_LOCK = threading.Lock()


def launch(start: Callable[[], Any], tensor: torch.Tensor) -> Any:
    """Launch the collective `start()` (a process group call returning its work) on
    the communication thread and return a work-like handle at once; a collective of
    CUDA tensors (`tensor` is one of its tensors) is launched here instead."""
    global _THREAD
    if tensor.device.type == "cuda":
        return start()
    if _THREAD is None or _THREAD.pid != os.getpid():
        with _LOCK:
            if _THREAD is None or _THREAD.pid != os.getpid():
                _THREAD = _Thread()
    pending = Pending(start)
    _THREAD.queue.put(pending)
    return pending
