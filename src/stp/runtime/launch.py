"""Starting the ranks: under torchrun, or locally through PyTorch's launcher API.

* Under `torchrun` (one node or many) every process already has RANK,
  WORLD_SIZE, MASTER_ADDR, ... in its environment; `init_distributed` reads
  them (the env:// method).
* Without torchrun, `launch_local` starts the workers itself with
  `torch.distributed.launcher.api.elastic_launch` (the engine behind
  torchrun --standalone: a c10d rendezvous on a free local port, no
  restarts), so one command trains on a laptop. When one worker fails the
  launcher stops the others; `launch_local` returns the failure instead of
  raising.
* A world of one process needs no launcher: `init_distributed` makes a
  single-rank group in memory.

Backend: NCCL when every local rank gets its own CUDA device, gloo on CPU.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["in_torchrun", "pick_device", "init_distributed", "LaunchResult", "launch_local"]

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
    device. `timeout` (seconds) bounds every collective and the rendezvous."""
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
        dist.init_process_group(backend, timeout=td)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
    return device


@dataclass
class LaunchResult:
    """What the local workers returned, or how they failed."""

    returns: dict[int, object]
    """Return value of each local rank that finished (all of them on success)."""
    exitcode: int
    """0 on success, else the first failed rank's exit status (1 if unknown)."""
    failed_ranks: list[int]


def launch_local(
    entry: Callable[..., object], args: tuple[object, ...], nprocs: int, *, quiet: bool = True
) -> LaunchResult:
    """Run `entry(*args)` in `nprocs` local worker processes (spawned, so
    `entry` must be a module-level function) with RANK/WORLD_SIZE/... set.

    `quiet` silences the launcher's own log lines (the workers print their
    own diagnoses).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if quiet:
        for name in ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"stp-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        # After one worker fails the others get SIGTERM, then SIGKILL this many
        # seconds later (a frozen worker must not hold the command for long).
        shutdown_timeout=5,
    )
    try:
        returns = elastic_launch(config, entry)(*args)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        first = failures[0][1]
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        return LaunchResult({}, code, [r for r, _ in failures])
    return LaunchResult(dict(returns), 0, [])
