"""Lowering: add point-to-point communication to a schedule's compute order.

A `Schedule` says what each rank computes and in which order; the runtime
also needs to know when to send and when to receive. `lower` turns the
per-rank compute lists into per-rank programs of compute actions (`Pass`,
`Block`) and communication actions (`Comm`), named as in
`torch.distributed.pipelining`:

    1SEND_F3    stage 1 sends its forward output of microbatch 3 to stage 2
    2RECV_F3    stage 2 receives that tensor (its forward input)
    2SEND_B3    stage 2 sends the input gradient of microbatch 3 to stage 1
    1RECV_B3    stage 1 receives it (its output gradient)

Rules (the runtime's point-to-point semantics, as validate.py assumes):

* A send follows the compute action that produced the tensor, at once.
  Sends are non-blocking; the executor completes them in the background.
* A hand-off between two stages on the same rank (the V tip, stages p-1 ->
  p on rank p-1, and every hand-off when p = 1) is local: no send, no
  receive.
* Receives are posted early: the receive for compute action k is posted
  just before compute action k - lookahead (default one action ahead), so
  the transfer overlaps the compute in between; the executor waits on it
  only right before action k. Receives on one channel (one sending rank
  to one receiving rank) are posted in the order the sender sends, moving a
  receive earlier when needed. Backends that match point-to-point messages
  by order rather than by tag (NCCL) then pair every receive with the right
  send:

      rank 0:  0F0  0SEND_F0  0F1  0SEND_F1
      rank 1:  1RECV_F0  1RECV_F1  1F0  1RECV_F2 ...   (lookahead 1:
               1RECV_F1 is posted before 1F0 runs)

* The sends that follow action k-1 and the receives posted before action k
  form one batch (one `batch_isend_irecv` call in the executor).

Pure: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum

from stp.schedule.ir import Action, Block, Kind, Pass, Schedule, passes_of

__all__ = ["CommOp", "Comm", "Lowered", "LoweredSchedule", "lower", "messages_in", "messages_out"]


class CommOp(StrEnum):
    """Point-to-point operation, PyTorch's names."""

    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_send(self) -> bool:
        return self in (CommOp.SEND_F, CommOp.SEND_B)


@dataclass(frozen=True, slots=True)
class Comm:
    """One send or receive of one stage boundary tensor.

    `stage` is the local stage that sends or receives, `peer` the pipeline
    rank at the other end, `peer_stage` the stage there.
    """

    stage: int
    op: CommOp
    mb: int
    peer: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    @property
    def peer_stage(self) -> int:
        downstream = self.op in (CommOp.SEND_F, CommOp.RECV_B)
        return self.stage + 1 if downstream else self.stage - 1

    @property
    def message(self) -> tuple[str, int, int]:
        """(direction F or B, producing stage, mb): the same key on both ends."""
        if self.op.is_send:
            return (self.op.value[-1], self.stage, self.mb)
        return (self.op.value[-1], self.peer_stage, self.mb)


Lowered = Pass | Block | Comm


def messages_in(p: Pass, num_stages: int) -> list[tuple[str, int, int]]:
    """Boundary tensors pass `p` consumes: (direction, producing stage, mb)."""
    if p.kind is Kind.F and p.stage > 0:
        return [("F", p.stage - 1, p.mb)]
    if p.kind in (Kind.B, Kind.BW) and p.stage < num_stages - 1:
        return [("B", p.stage + 1, p.mb)]
    return []


def messages_out(p: Pass, num_stages: int) -> list[tuple[str, int, int]]:
    """Boundary tensors pass `p` produces: (direction, producing stage, mb)."""
    if p.kind is Kind.F and p.stage < num_stages - 1:
        return [("F", p.stage, p.mb)]
    if p.kind in (Kind.B, Kind.BW) and p.stage > 0:
        return [("B", p.stage, p.mb)]
    return []


def _consumer(msg: tuple[str, int, int]) -> int:
    """Stage that consumes a message."""
    d, s, _ = msg
    return s + 1 if d == "F" else s - 1


@dataclass(frozen=True)
class LoweredSchedule:
    """Per-rank programs of compute and communication actions."""

    schedule: Schedule
    actions: tuple[tuple[Lowered, ...], ...]
    lookahead: int

    def rows(self) -> list[list[str]]:
        return [[str(a) for a in acts] for acts in self.actions]

    def format(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(row) for r, row in enumerate(self.rows()))

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if not isinstance(a, Comm)]


def lower(schedule: Schedule, *, lookahead: int = 1) -> LoweredSchedule:
    """Insert SEND/RECV actions into every rank's compute order (rules above).

    `lookahead` >= 0 is how many compute actions ahead of its use a receive is
    posted (0: right before the action that needs it). Raises ValueError on a
    negative lookahead; the schedule is assumed valid (`validate`).
    """
    if not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"lookahead {lookahead!r} not accepted; it must be an integer >= 0")
    S = schedule.num_stages
    owner = schedule.stage_to_rank
    compute = [list(acts) for acts in schedule.actions]

    # Sends, in each sender's program order: channel (src, dst) -> messages.
    channel: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    sends_after: list[list[list[Comm]]] = [[[] for _ in acts] for acts in compute]
    for r, acts in enumerate(compute):
        for k, a in enumerate(acts):
            for p in passes_of(a):
                for msg in messages_out(p, S):
                    dst = owner[_consumer(msg)]
                    if dst == r:
                        continue  # local hand-off (V tip): no send
                    op = CommOp.SEND_F if msg[0] == "F" else CommOp.SEND_B
                    sends_after[r][k].append(Comm(p.stage, op, p.mb, dst))
                    channel[(r, dst)].append(msg)

    # Where each receive is needed: message -> compute index on its rank.
    need: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(compute):
        for k, a in enumerate(acts):
            for p in passes_of(a):
                for msg in messages_in(p, S):
                    if owner[msg[1]] != r:
                        need[msg] = k

    # Post each receive `lookahead` actions early, then keep the channel's
    # send order: walking the channel backwards, a receive is posted no later
    # than the one after it.
    # (slot, sending rank, position in that channel, receive) per receiving rank
    posted_at: dict[int, list[tuple[int, int, int, Comm]]] = defaultdict(list)
    for (src, dst), msgs in sorted(channel.items()):
        if any(msg not in need for msg in msgs):
            missing = next(msg for msg in msgs if msg not in need)
            raise ValueError(
                f"rank {src} sends {missing} to rank {dst}, which never consumes it; "
                "validate the schedule first"
            )
        latest = len(compute[dst])
        for seq in range(len(msgs) - 1, -1, -1):
            msg = msgs[seq]
            latest = min(latest, max(0, need[msg] - lookahead))
            op = CommOp.RECV_F if msg[0] == "F" else CommOp.RECV_B
            posted_at[dst].append((latest, src, seq, Comm(_consumer(msg), op, msg[2], src)))
    sent = {msg for msgs in channel.values() for msg in msgs}
    for msg in need:
        if msg not in sent:
            raise ValueError(
                f"stage {_consumer(msg)} needs {msg} from rank {owner[msg[1]]}, which never "
                "sends it; validate the schedule first"
            )
    # Per rank, (slot, receive) in posting order: by slot, then channel order.
    recvs = [
        [(t[0], t[3]) for t in sorted(posted_at[r], key=lambda t: t[:3])]
        for r in range(len(compute))
    ]

    out: list[tuple[Lowered, ...]] = []
    for r, acts in enumerate(compute):
        prog: list[Lowered] = []
        pending = recvs[r]
        j = 0
        for k, a in enumerate(acts):
            if k > 0:
                prog.extend(sends_after[r][k - 1])
            while j < len(pending) and pending[j][0] <= k:
                prog.append(pending[j][1])
                j += 1
            prog.append(a)
        if acts:
            prog.extend(sends_after[r][-1])
        assert j == len(pending), f"rank {r}: receives posted after the last action"
        out.append(tuple(prog))
    return LoweredSchedule(schedule, tuple(out), lookahead)
