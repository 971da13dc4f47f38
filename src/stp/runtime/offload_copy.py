"""Copies of storage bytes between the device and the host, for activation
offload (stp.runtime.offload): the stream rules live here.

On CUDA (compute stream C, side streams D2H and H2D):

    C   : [F(s,i)] [other actions ...........] [wait ev_in] [B(s,i)]
    D2H :          [copy out]->ev_out
    H2D :                       RELOAD: [copy in]->ev_in

  * the copy out waits for C (the forward wrote the storage on C);
  * the copy in waits for C (the reload allocated the storage on C, so the
    block belongs to C's stream and its previous users there are done);
  * C waits on ev_in before the backward (`wait`), the host does not.
Freeing the device storage only after ev_out, and dropping a host buffer only
after the copies that use it, is the offloader's part.

On CPU the copies are synchronous, into separate host buffers, nothing pinned.
On CUDA the host buffers are ranges of a few pinned slabs (stp.runtime.host_pool),
not one `cudaHostAlloc` per offloaded storage.
"""

from __future__ import annotations

from typing import Protocol

import torch

from stp.runtime.host_pool import HostPool

__all__ = ["CopyEvent", "Copier", "HostBuffer", "HostCopier", "CudaCopier", "byte_view"]

HostBuffer = torch.UntypedStorage | torch.Tensor
"""A host copy: a storage of its own, or a uint8 tensor over a range of a pool's slab
(its storage is the whole slab, so the tensor itself is what is kept)."""


class CopyEvent(Protocol):
    def query(self) -> bool:
        """True once the copy has completed."""
        ...


class Copier(Protocol):
    """Moves storage bytes between the device and the host."""

    def to_host(self, src: torch.UntypedStorage) -> tuple[HostBuffer, CopyEvent]:
        """Start copying `src` into a new host buffer; returns (buffer, event). The
        buffer is dropped only after the copies that use it have ended."""
        ...

    def to_device(self, dst: torch.UntypedStorage, host: HostBuffer) -> CopyEvent:
        """Start copying `host` into the (allocated) device storage `dst`."""
        ...

    def wait(self, event: CopyEvent) -> None:
        """Make the compute stream wait for the copy (not the host)."""
        ...

    def synchronize(self, event: CopyEvent) -> None:
        """Block the host until the copy has completed."""
        ...


class _Done:
    def query(self) -> bool:
        return True


_DONE = _Done()


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over `storage` (copy_ and fill_ work on tensors)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostCopier:
    """CPU: synchronous copies into separate host buffers."""

    def to_host(self, src: torch.UntypedStorage) -> tuple[torch.UntypedStorage, CopyEvent]:
        host = torch.UntypedStorage(src.nbytes())
        host.copy_(src)
        return host, _DONE

    def to_device(self, dst: torch.UntypedStorage, host: HostBuffer) -> CopyEvent:
        dst.copy_(host)  # type: ignore[type-var]  # a host buffer is an UntypedStorage here
        return _DONE

    def wait(self, event: CopyEvent) -> None:
        pass

    def synchronize(self, event: CopyEvent) -> None:
        pass


class CudaCopier:
    """CUDA: pinned host buffers from one pool (`pool`, default a HostPool of its
    default size), one side stream each way, an event per copy."""

    def __init__(self, device: torch.device, pool: HostPool | None = None) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.pool = HostPool() if pool is None else pool

    def to_host(self, src: torch.UntypedStorage) -> tuple[HostBuffer, CopyEvent]:
        host = self.pool.take(src.nbytes())
        # the forward wrote src on the compute stream: copy only after it
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(byte_view(src), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        return host, event

    def to_device(self, dst: torch.UntypedStorage, host: HostBuffer) -> CopyEvent:
        # dst was just allocated on the compute stream: write it only after that
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d):
            src = host if isinstance(host, torch.Tensor) else byte_view(host)
            byte_view(dst).copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return event

    def wait(self, event: CopyEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]  # a CUDA copier's events are torch.cuda.Events

    def synchronize(self, event: CopyEvent) -> None:
        event.synchronize()  # type: ignore[attr-defined]  # a CUDA copier's events are torch.cuda.Events
