"""A rank joining its job: the device it runs on, the default process group
(from torchrun's environment, or one in-memory rank when nothing launched
it), and the meeting in the launcher's store that lets ranks start seconds
apart (`wait_for_every_rank`, up to STARTUP_S). stp.runtime.launch is the
other side: the launcher that starts and watches the ranks.

Backend: NCCL when every local rank gets its own CUDA device, gloo on CPU.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from stp.runtime.errors import CommTimeout
from stp.runtime.store import shared_store

__all__ = ["STARTUP_S", "in_torchrun", "init_distributed", "pick_device", "wait_for_every_rank"]

STARTUP_S = 300.0
"""Seconds the ranks may take to start (import torch, read settings) before they
meet; apart from the job's timeout, which bounds waits between running ranks."""

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def in_torchrun() -> bool:
    """True when this process was started by torchrun (or another env:// launcher)."""
    return all(k in os.environ for k in _ENV)


def pick_device(local_world: int, local_rank: int) -> torch.device:
    """cuda:local_rank if every local rank can have its own GPU, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(*, timeout: float, device: torch.device | None = None) -> torch.device:
    """Initialise the default process group from the environment (or a
    single in-memory rank when there is no launcher) and return this rank's
    device. `timeout` (seconds) bounds every collective and the rendezvous;
    ranks that start at different times first wait for each other up to
    STARTUP_S (under a launcher that shares its store)."""
    if dist.is_initialized():
        if device is not None:
            return device
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = device or pick_device(local_world, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # Local workers share the cores; oversubscribed intra-op threads slow everyone.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    td = timedelta(seconds=timeout)
    if in_torchrun():
        wait_for_every_rank()
        dist.init_process_group(backend, timeout=td)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
    atexit.register(_destroy_at_exit)
    return device


def _destroy_at_exit() -> None:
    """Tear the process groups down before the interpreter does: a gloo group left to
    the interpreter's shutdown sometimes ends the process with "terminate called
    without an active exception" (SIGABRT) after a finished run, which torchrun
    reports as a failure. A user script that destroys the group itself is left alone."""
    if dist.is_initialized():
        dist.destroy_process_group()


def wait_for_every_rank(startup: float = STARTUP_S) -> None:
    """Block until every rank got here (at most `startup` seconds), through the
    launcher's store when the workers share it (torchrun's agent store, or
    launch_local's): a rank that imports torch seconds after the others then
    does not count against the short timeout of the rendezvous that follows.
    CommTimeout naming the ranks that did not arrive."""
    shared = shared_store(startup)
    if shared is None:
        return
    store, rank, world = shared.store, shared.rank, shared.world_size
    prefix = shared.key("up")
    store.set(f"{prefix}/{rank}", "1")
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=startup))
    except RuntimeError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise CommTimeout(f"rank(s) {missing} did not start within {startup:g} s",
                          where=f"rank {rank}", action="start-up") from None
