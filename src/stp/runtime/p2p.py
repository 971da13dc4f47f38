"""Point-to-point transfers between pipeline ranks, batched, with timeouts.

The executor hands over each run of consecutive SEND/RECV actions of a
lowered program (stp.schedule.lower) as one batch; the batch goes out in one
`batch_isend_irecv` call (DualPipe's "commit" primitive; NCCL coalesces the
batch into one group launch, gloo issues the ops one by one). Nothing here
blocks: a receive is waited on only when the compute action that needs it
is about to run, a send only at the end of the step.

Matching. Every message gets a tag derived from (direction, producing
stage, microbatch), so gloo matches by tag whatever the order; NCCL ignores
tags and matches in order per channel, which the lowering guarantees (it
posts receives in the sender's order).

Caveat (NCCL, untested here: this project's CI has no GPU): NCCL may
return one work for a whole batch, so waiting on one receive waits on the
batch's sends too; the executor handles the single work, but whether every
schedule stays deadlock-free under that stricter rule has only been
reasoned about, not run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stp.runtime.errors import RankError, wrap
from stp.schedule.lower import Comm

__all__ = ["P2P", "Transfer", "message_tag"]


def message_tag(comm: Comm, num_stages: int) -> int:
    """Tag shared by a send and its receive: (mb, producing stage, direction)."""
    direction, stage, mb = comm.message
    return (mb * num_stages + stage) * 2 + (direction == "B")


@dataclass
class Transfer:
    """One posted send or receive and the work handles that complete it."""

    comm: Comm
    tensor: torch.Tensor
    works: list[dist.Work]
    peer_rank: int
    """Global rank at the other end (for messages)."""
    done: bool = False

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)


class P2P:
    """Posts batches of pipeline transfers on `group` and waits with a timeout.

    `peers[r]` is the global rank of pipeline rank r (group rank r of
    `group`); `where` names this rank in messages.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        peers: list[int],
        num_stages: int,
        *,
        timeout: float,
        where: str,
    ) -> None:
        self.group = group
        self.peers = peers
        self.num_stages = num_stages
        self.timeout = timeout
        self.where = where
        self._sends: list[Transfer] = []

    def post(self, batch: list[tuple[Comm, torch.Tensor]]) -> list[Transfer]:
        """Issue one batch of sends and receives; returns one Transfer per op."""
        ops = []
        for comm, tensor in batch:
            fn = dist.isend if comm.op.is_send else dist.irecv
            ops.append(dist.P2POp(
                fn, tensor, group=self.group, group_peer=comm.peer,
                tag=message_tag(comm, self.num_stages),
            ))
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as e:
            peers = ", ".join(
                f"pipeline rank {r} (global rank {self.peers[r]})"
                for r in sorted({c.peer for c, _ in batch})
            )
            names = " ".join(str(c) for c, _ in batch)
            raise wrap(e, where=self.where, action=f"posting {names}", peers=peers) from e
        # A coalescing backend (NCCL) may return one work for the whole batch:
        # every op then completes with it.
        coalesced = len(works) != len(ops)
        per_op = [list(works)] * len(ops) if coalesced else [[w] for w in works]
        transfers = [
            Transfer(comm, tensor, w, self.peers[comm.peer])
            for (comm, tensor), w in zip(batch, per_op, strict=True)
        ]
        self._sends.extend(t for t in transfers if t.comm.op.is_send)
        if len(self._sends) > 64:
            self._sends = [t for t in self._sends if not t.is_completed()]
        return transfers

    def wait(self, t: Transfer, *, needed_by: str = "") -> torch.Tensor:
        """Block until transfer `t` completes, at most `timeout` seconds."""
        if not t.done:
            start = time.monotonic()
            for work in t.works:
                try:
                    work.wait(timedelta(seconds=self.timeout))
                except RuntimeError as e:
                    raise self._failure(t, e, needed_by, time.monotonic() - start) from e
            t.done = True
        return t.tensor

    def drain(self) -> None:
        """Wait for every send still in flight (end of a step)."""
        sends, self._sends = self._sends, []
        for t in sends:
            self.wait(t)

    def _failure(
        self, t: Transfer, err: RuntimeError, needed_by: str, waited: float
    ) -> RankError:
        """The error to raise (stp.runtime.errors.wrap): a timeout, a peer that closed
        the connection (it ended: crashed, killed, or stopped after its own
        failure; the message says how long this rank had waited, so a reader
        tells it from the timeout), or another backend failure."""
        return wrap(
            err, where=self.where,
            action=str(t.comm) + (f" before {needed_by}" if needed_by else ""),
            peers=f"pipeline rank {t.comm.peer} (global rank {t.peer_rank}, "
                  f"stage {t.comm.peer_stage})",
            awaiting="a matching receive" if t.comm.op.is_send else "data",
            waited=waited, timeout=self.timeout,
        )
