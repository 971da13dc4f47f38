"""The communication thread (stp.models.moe.comm_thread) launches collectives in the
order they were handed to it (every rank of a group must issue them in the same
order), its handles wait for the launch and then the work, and a launch that failed
raises in the waiter instead of vanishing in the thread."""

from __future__ import annotations

import threading

import pytest
import torch

from stp.models.moe import comm_thread


class _Work:
    def __init__(self, log: list[int], k: int) -> None:
        self.log, self.k, self.done = log, k, threading.Event()
        log.append(k)

    def wait(self) -> bool:
        self.done.set()
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


def test_launches_run_in_order_and_wait_waits_for_the_work():
    log: list[int] = []
    cpu = torch.zeros(1)
    handles = [comm_thread.launch(lambda k=k: _Work(log, k), cpu) for k in range(50)]
    for h in reversed(handles):
        assert h.wait() is True
    assert log == list(range(50))
    assert all(h.is_completed() for h in handles)


def test_a_failed_launch_raises_in_the_waiter():
    def broken() -> None:
        raise RuntimeError("process group is gone")

    h = comm_thread.launch(broken, torch.zeros(1))
    with pytest.raises(RuntimeError, match="process group is gone"):
        h.wait()
    assert not h.is_completed()  # so the runner waits, and sees the error
    assert comm_thread.launch(lambda: _Work([], 0), torch.zeros(1)).wait()  # thread alive
