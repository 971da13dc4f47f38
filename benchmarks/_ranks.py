"""Start a benchmark's ranks as local processes and gather what each reports.

The benchmarks that measure one thing across a few gloo ranks (not through
`stp train`) share this: a free loopback port for the rendezvous, one spawned
process per rank running `worker(rank, port, args, queue)`, which puts
`(rank, result)` on the queue; the results come back as {rank: result}.
"""

from __future__ import annotations

import datetime
import os
import queue as queues
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def join_world(rank: int, port: int, world: int, *, timeout: float) -> None:
    """In a rank `run_ranks` started: one thread for torch (the ranks share the
    cores), the environment stp's runtime reads, and the gloo process group;
    `timeout` seconds bounds its collectives."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def run_ranks(worker: Callable[..., None], world: int, args: Any, *,
              timeout: float) -> dict[int, Any]:
    """Run `worker` on `world` local ranks (module doc); `timeout` seconds bounds the
    wait for the results. A rank that dies without reporting ends the run at once
    (SystemExit naming it; the others are terminated), instead of a wait for the
    timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # the ranks meet on this machine only
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, value = queue.get(timeout=0.5)
                results[rank] = value
            except queues.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead or time.monotonic() > deadline:
                    why = f"rank {dead[0]} exited with status {procs[dead[0]].exitcode}" \
                        if dead else f"no result within {timeout:g} s"
                    raise SystemExit(f"benchmark failed: {why}") from None
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world:
                p.terminate()
            p.join()
    return results
