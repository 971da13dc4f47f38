"""Pinned host buffers for activation offload, carved out of a few large slabs.

Pinning is slow per call: a whole-process profile of a one-GPU run counted 309
`cudaHostAlloc` calls taking 5.8 s of start-up, one per offloaded storage of the
first step (torch's caching host allocator keeps them for later steps, but each
first request pins afresh). `HostPool` pins `initial_bytes` once and hands out
byte ranges of it; a request that fits nowhere pins a new slab at least as large
as everything pinned so far, so a step that needs B bytes of host buffers pins
about log2(B / initial_bytes) times, not once per storage.

A block is handed out as a uint8 tensor over its range and returns to the pool
when that tensor is garbage (a weakref finaliser): the offloader drops a host
buffer only after the copies that use it have ended (stp.runtime.offload), so a
returned range is never still being read or written. Free ranges are kept
sorted and merged with their neighbours.
"""

from __future__ import annotations

import bisect
import weakref

import torch

__all__ = ["HostPool"]

ALIGN = 512
"""Bytes every block starts on (a cache line and a DMA-friendly boundary)."""


class HostPool:
    """First-fit allocator of host byte ranges over slabs pinned in one go each.

    `pin=False` makes ordinary host slabs (what the tests use on a machine without
    a GPU; a CPU run needs no pool, its copies are synchronous)."""

    def __init__(self, initial_bytes: int = 256 << 20, *, pin: bool = True) -> None:
        if initial_bytes < 1:
            raise ValueError(f"initial_bytes must be >= 1, got {initial_bytes}")
        self.initial_bytes = initial_bytes
        self.pin = pin
        self.slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (start, size)
        self.in_use = 0
        """Bytes handed out and not yet returned."""

    @property
    def pinned_bytes(self) -> int:
        """Bytes of every slab."""
        return sum(s.numel() for s in self.slabs)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of `nbytes` bytes, returned to the pool when garbage."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for slab, free in enumerate(self._free):
            for i, (start, span) in enumerate(free):
                if span >= size:
                    if span == size:
                        del free[i]
                    else:
                        free[i] = (start + size, span - size)
                    return self._hand_out(slab, start, size, nbytes)
        grow = max(self.initial_bytes, size, self.pinned_bytes)
        self.slabs.append(torch.empty(grow, dtype=torch.uint8, pin_memory=self.pin))
        self._free.append([(size, grow - size)] if grow > size else [])
        return self._hand_out(len(self.slabs) - 1, 0, size, nbytes)

    def _hand_out(self, slab: int, start: int, size: int, nbytes: int) -> torch.Tensor:
        block = self.slabs[slab][start:start + nbytes]
        self.in_use += size
        weakref.finalize(block, self._give_back, slab, start, size)
        return block

    def _give_back(self, slab: int, start: int, size: int) -> None:
        self.in_use -= size
        free = self._free[slab]
        i = bisect.bisect(free, (start, size))
        free.insert(i, (start, size))
        # merge with the right neighbour, then the left one
        if i + 1 < len(free) and start + size == free[i + 1][0]:
            free[i] = (start, size + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])
