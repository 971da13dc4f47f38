"""The launcher's store, as the workers reach it.

torchrun's agent hosts a TCPStore that its workers share (it sets
TORCHELASTIC_USE_AGENT_STORE=True and points MASTER_ADDR:MASTER_PORT at
it); stp's own launcher (stp.runtime.launch) does the same. Through it the
workers meet before the process group exists (stp.runtime.launch's start-up
wait, stp.runtime.agree), and beat (stp.runtime.watch). Keys are scoped by
the run and its restart, so a restarted run never reads an old value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["SharedStore", "shared_store"]


@dataclass
class SharedStore:
    """A client of the launcher's store, and this worker's place in the world."""

    store: dist.Store
    rank: int
    world_size: int

    def key(self, name: str) -> str:
        """`stp/<name>/<run id>/<restart>`: `name` within this run's attempt."""
        env = os.environ
        return (f"stp/{name}/{env.get('TORCHELASTIC_RUN_ID', '')}/"
                f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def shared_store(timeout: float) -> SharedStore | None:
    """A new client of the launcher's store (its operations wait at most `timeout`
    seconds), or None without one: a single process, or a launcher whose store
    the workers do not share."""
    import torch.distributed as dist  # here: stp.runtime.watch loads before torch

    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("WORLD_SIZE", 1)) < 2:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    return SharedStore(store, int(env["RANK"]), int(env["WORLD_SIZE"]))
