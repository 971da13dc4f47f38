"""Settings every rank must share, compared before the ranks build anything together.

Nodes started with different settings (another --pp, --layers or --seed)
would create different process groups and wait on each other until a
timeout that says nothing about the cause. Before `init_process_group`,
`agree` has every rank write its settings into the launcher's store
(torchrun's agent store: every worker is a client of it at
MASTER_ADDR:MASTER_PORT when TORCHELASTIC_USE_AGENT_STORE is set, and so is
every worker of stp.runtime.launch); rank 0 compares each rank's with its
own and publishes one verdict that every rank waits for: agreement, or the
first rank and setting that differ. Settings and verdict are signed with the
job's secret (stp.runtime.store), so another client of the store cannot fake
either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from stp.runtime.store import seal, shared_store, unseal

__all__ = ["SettingsDiffer", "agree", "first_difference"]


class SettingsDiffer(ValueError):
    """Ranks were started with different settings (or one never reported them)."""


def first_difference(
    reference: Mapping[str, str], other: Mapping[str, str]
) -> tuple[str, str, str] | None:
    """(name, reference's value, other's value) of the first setting that differs,
    in the reference's order; None when they are the same."""
    for name in list(reference) + [n for n in other if n not in reference]:
        mine, theirs = reference.get(name, "(unset)"), other.get(name, "(unset)")
        if mine != theirs:
            return name, mine, theirs
    return None


def _verdict(
    store: dist.Store, prefix: str, mine: Mapping[str, str], world: int, timeout: float
) -> str:
    """Rank 0: "" when every rank's settings equal `mine`, else the message."""
    keys = [f"{prefix}/{r}" for r in range(1, world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # the wait timed out
        missing = next((r for r, k in enumerate(keys, 1) if not store.check([k])), "?")
        return (f"rank {missing} did not report its settings within {timeout:g} s: "
                "was every node started?")
    for r, key in enumerate(keys, 1):
        value = unseal(key, store.get(key))  # signed with the job's secret (stp.runtime.store)
        if value is None:
            return (f"rank {r}'s settings in the job's store are not signed with this job's "
                    "secret: set the same STP_JOB_TOKEN on every node")
        diff = first_difference(mine, json.loads(value))
        if diff is not None:
            name, ours, theirs = diff
            return (f"ranks were started with different settings: {name} is {ours} on rank 0 "
                    f"but {theirs} on rank {r}; start every node with the same settings")
    return ""


def agree(settings: Mapping[str, str], *, timeout: float) -> None:
    """Compare `settings` across the ranks (see the module doc): SettingsDiffer on
    every rank when they differ. Without a shared store (a single process, or a
    launcher that does not share one) there is nothing to compare with."""
    shared = shared_store(timeout)
    if shared is None:
        return
    store, rank, world = shared.store, shared.rank, shared.world_size
    prefix = shared.key("settings")
    key = f"{prefix}/{rank}"
    store.set(key, seal(key, json.dumps(dict(settings))))
    verdict = f"{prefix}/verdict"
    if rank == 0:
        store.set(verdict, seal(verdict, _verdict(store, prefix, settings, world, timeout)))
    try:  # rank 0 may wait `timeout` for a missing rank before it answers
        store.wait([verdict], timedelta(seconds=2 * timeout + 5))
        error = unseal(verdict, store.get(verdict))
    except RuntimeError:
        raise SettingsDiffer(f"rank 0 did not compare the ranks' settings within {timeout:g} s: "
                             "is it running?") from None
    if error is None:
        raise SettingsDiffer("the settings verdict in the job's store is not signed with this "
                             "job's secret: set the same STP_JOB_TOKEN on every node")
    if error:
        raise SettingsDiffer(error)
