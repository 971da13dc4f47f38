"""Run a function in N gloo processes on 127.0.0.1 (a free port), never hanging.

`run_dist(fn, world_size, *args)` spawns one process per rank, sets the
torchrun-style environment, initialises gloo with a short timeout, calls
`fn(rank, world_size, *args)` and returns the per-rank results in rank order.
A rank that raises makes run_dist raise `DistFailure` with every rank's
error; a run past `timeout` seconds is killed and reported as hung.
`fn` must be a module-level function (spawned processes import it).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_dist", "DistFailure", "free_port"]


class DistFailure(AssertionError):
    """One or more ranks failed or hung; `errors[rank]` is each failed rank's text."""

    def __init__(self, message: str, errors: dict[int, str], elapsed: float) -> None:
        super().__init__(message)
        self.errors, self.elapsed = errors, elapsed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, pg_timeout: float,
    results: Any, args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException as e:  # report everything, including SystemExit
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        # Flush the result, then leave at once: destroy_process_group after a
        # failure can block on peers that are gone.
        results.close()
        results.join_thread()
        os._exit(0)


def run_dist(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size gloo ranks; see module doc."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, pg_timeout, results, args))
        for r in range(world_size)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    try:
        while len(got) < world_size:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                break
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, out)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    elapsed = time.monotonic() - start
    errors = {r: out for r, (ok, out) in got.items() if not ok}
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        text = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        if missing:
            text += f"\nranks {missing} did not report within {timeout:g} s (hung or crashed)"
        raise DistFailure(f"distributed run failed after {elapsed:.1f} s:{text}", errors, elapsed)
    return [got[r][1] for r in range(world_size)]
