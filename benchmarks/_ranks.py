"""Start a benchmark's ranks as local processes and gather what each reports.

The benchmarks that measure one thing across a few gloo ranks (not through
`stp train`) share this: a free loopback port for the rendezvous, one spawned
process per rank running `worker(rank, port, args, queue)`, which puts
`(rank, result)` on the queue; the results come back as {rank: result}.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], world: int, args: Any, *,
              timeout: float) -> dict[int, Any]:
    """Run `worker` on `world` local ranks (module doc); `timeout` seconds bounds the
    wait for each rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # the ranks meet on this machine only
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
    return results
