"""One all-reduce and one point-to-point send, timed on a launched world: the
figures `stp bench fidelity` hands the simulator as its costs."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from stp.models.emulated import hold
from stp.runtime.mesh import Mesh

__all__ = ["measure_allreduce", "measure_p2p", "mean_over"]


def measure_allreduce(
    group: dist.ProcessGroup, shape: tuple[int, ...], repeats: int = 30, after: float = 0.0
) -> tuple[float, float]:
    """(launch, completion) seconds of a sum all-reduce of `shape` floats: the mean
    time of the async launch call, and the mean time from its return to the end of
    the wait. `after` > 0: each one follows an emulated unit of that many seconds,
    as in a run (on a VM, an all-reduce after an idle wait is several times slower
    than back to back); else each follows a barrier."""
    t = torch.zeros(shape)
    launch, done = [], []
    for k in range(repeats + 3):
        if after > 0:
            hold(after)
        else:
            dist.barrier(group=group)
        start = time.perf_counter()
        work = dist.all_reduce(t, group=group, async_op=True)
        mid = time.perf_counter()
        work.wait()
        if k >= 3:
            launch.append(mid - start)
            done.append(time.perf_counter() - mid)
    return statistics.mean(launch), statistics.mean(done)


def measure_p2p(mesh: Mesh, shape: tuple[int, ...], repeats: int = 30) -> float:
    """Median one-way seconds of a `shape` send between pipeline ranks 0 and 1
    (half a ping-pong), measured by pipeline rank 0 and shared with all."""
    t = torch.zeros(shape)
    pp, peers, group = mesh.coord.pp, mesh.ranks["pp"], mesh.pp_group
    times = []
    for k in range(repeats + 3):
        dist.barrier(group=group)
        start = time.perf_counter()
        if pp == 0:
            dist.send(t, peers[1], group=group)
            dist.recv(t, peers[1], group=group)
        elif pp == 1:
            dist.recv(t, peers[0], group=group)
            dist.send(t, peers[0], group=group)
        if k >= 3:
            times.append((time.perf_counter() - start) / 2)
    out = [statistics.median(times)]
    dist.broadcast_object_list(out, src=peers[0], group=group)
    return float(out[0])


def mean_over(mesh: Mesh, value: float) -> float:
    """Mean of `value` over every rank of the world."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / mesh.dims.world_size
