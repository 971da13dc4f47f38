"""Batches built ahead on a background thread, so reading and packing data never
stalls a step.

The thread builds batch(first), batch(first + 1), ... up to `depth` ahead of the
step that asks. Batches stay a pure function of (seed, step) and the checkpoint
records the steps trained (the consumed position), never the prefetched ones: a
resume rebuilds what was prefetched and not trained. A step asked out of order
is built on the spot; an error while building is raised by the step that asks
for that batch.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

__all__ = ["Batches", "Prefetched"]


class Batches(Protocol):
    def batch(self, step: int) -> Any: ...


class Prefetched:
    """`batches` with batch(first) .. batch(stop - 1) built ahead, `depth` at most."""

    def __init__(self, batches: Batches, first: int, stop: int, depth: int = 2) -> None:
        self.batches, self.next, self.stop = batches, first, stop
        self._ready: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue(depth)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(first,), daemon=True,
                                        name="stp-prefetch")
        self._thread.start()

    def _fill(self, step: int) -> None:
        while step < self.stop and not self._halt.is_set():
            try:
                item: tuple[int, Any, BaseException | None] = (step, self.batches.batch(step),
                                                               None)
            except BaseException as e:  # handed to the step that needs this batch
                item = (step, None, e)
            while not self._halt.is_set():
                try:
                    self._ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def batch(self, step: int) -> Any:
        if step != self.next or step >= self.stop or (not self._thread.is_alive()
                                                      and self._ready.empty()):
            return self.batches.batch(step)
        got, value, error = self._ready.get()
        self.next = got + 1
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        """Stop the thread (it may be building one batch; it is a daemon)."""
        self._halt.set()
