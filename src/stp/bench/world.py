"""A benchmark worker's world: joined before it measures, left after, even when
it fails (a worker left in the group would hang its peers' teardown)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from stp.runtime.launch import init_distributed

__all__ = ["in_world"]

S = TypeVar("S")
R = TypeVar("R")


def in_world(worker: Callable[[S], R], settings: S, timeout: float) -> R:
    """`worker(settings)` inside the process group of a launched rank."""
    init_distributed(timeout=timeout)
    try:
        return worker(settings)
    finally:
        dist.destroy_process_group()
