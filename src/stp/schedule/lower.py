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
from typing import NamedTuple

from stp.schedule.ir import Action, Block, Kind, Pass, Schedule, passes_of

__all__ = ["CommOp", "Comm", "Dir", "Message", "Lowered", "LoweredSchedule", "lower",
           "messages_in", "messages_out"]


class CommOp(StrEnum):
    """Point-to-point operation, PyTorch's names."""

    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_send(self) -> bool:
        return self in (CommOp.SEND_F, CommOp.SEND_B)


class Dir(StrEnum):
    """Which way a stage-boundary tensor flows: F, a forward's output activation
    (to the next stage), or B, a backward's input gradient (to the previous one)."""

    F = "F"
    B = "B"


class Message(NamedTuple):
    """One stage-boundary tensor, the same key on both ends of a send: its
    direction, the stage that produces it and the microbatch."""

    dir: Dir
    stage: int
    mb: int

    @property
    def consumer(self) -> int:
        """The stage that reads it."""
        return self.stage + 1 if self.dir is Dir.F else self.stage - 1

    @staticmethod
    def output_of(p: Pass) -> Message:
        """What pass p produces (a W pass: what its B produced, which it consumes)."""
        return Message(Dir.F if p.kind is Kind.F else Dir.B, p.stage, p.mb)

    @staticmethod
    def input_of(p: Pass) -> Message:
        """What pass p reads from a neighbouring stage (for F: the previous stage's
        output; for B/BW: the next stage's input gradient)."""
        if p.kind is Kind.F:
            return Message(Dir.F, p.stage - 1, p.mb)
        return Message(Dir.B, p.stage + 1, p.mb)


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
    def message(self) -> Message:
        """The tensor sent or received: the same key on both ends."""
        stage = self.stage if self.op.is_send else self.peer_stage
        return Message(Dir(self.op.value[-1]), stage, self.mb)


Lowered = Pass | Block | Comm


def messages_in(p: Pass, num_stages: int) -> list[Message]:
    """Boundary tensors pass `p` consumes."""
    if p.kind is Kind.F and p.stage > 0:
        return [Message.input_of(p)]
    if p.kind in (Kind.B, Kind.BW) and p.stage < num_stages - 1:
        return [Message.input_of(p)]
    return []


def messages_out(p: Pass, num_stages: int) -> list[Message]:
    """Boundary tensors pass `p` produces."""
    if p.kind is Kind.F and p.stage < num_stages - 1:
        return [Message.output_of(p)]
    if p.kind in (Kind.B, Kind.BW) and p.stage > 0:
        return [Message.output_of(p)]
    return []


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


Sends = dict[tuple[int, int], list[Message]]
"""Channel (sending rank, receiving rank) -> its messages in the sender's order."""


def lower(schedule: Schedule, *, lookahead: int = 1) -> LoweredSchedule:
    """Insert SEND/RECV actions into every rank's compute order (rules above).

    `lookahead` >= 0 is how many compute actions ahead of its use a receive is
    posted (0: right before the action that needs it). Raises ValueError on a
    negative lookahead; the schedule is assumed valid (`validate`).
    """
    if not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"lookahead {lookahead!r} not accepted; it must be an integer >= 0")
    compute = [list(acts) for acts in schedule.actions]
    channel, sends_after = _sends(schedule)
    recvs = _receives(schedule, channel, _needed_at(schedule), lookahead)
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


def _sends(schedule: Schedule) -> tuple[Sends, list[list[list[Comm]]]]:
    """Every send, in each sender's program order: (the channels, and per rank
    and compute index the sends that follow that action)."""
    owner, S = schedule.stage_to_rank, schedule.num_stages
    channel: Sends = defaultdict(list)
    sends_after: list[list[list[Comm]]] = [[[] for _ in acts] for acts in schedule.actions]
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            for p in passes_of(a):
                for msg in messages_out(p, S):
                    dst = owner[msg.consumer]
                    if dst == r:
                        continue  # local hand-off (V tip): no send
                    op = CommOp.SEND_F if msg.dir is Dir.F else CommOp.SEND_B
                    sends_after[r][k].append(Comm(p.stage, op, p.mb, dst))
                    channel[(r, dst)].append(msg)
    return channel, sends_after


def _needed_at(schedule: Schedule) -> dict[Message, int]:
    """Where each received message is needed: message -> compute index on its rank."""
    owner, S = schedule.stage_to_rank, schedule.num_stages
    need: dict[Message, int] = {}
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            for p in passes_of(a):
                for msg in messages_in(p, S):
                    if owner[msg.stage] != r:
                        need[msg] = k
    return need


def _receives(schedule: Schedule, channel: Sends, need: dict[Message, int],
              lookahead: int) -> list[list[tuple[int, Comm]]]:
    """Per rank, (compute index it is posted before, receive) in posting order.

    Each receive is posted `lookahead` actions early, then the channel's send
    order is kept: walking the channel backwards, a receive is posted no later
    than the one after it."""
    owner = schedule.stage_to_rank
    # (slot, sending rank, position in that channel, receive) per receiving rank
    posted_at: dict[int, list[tuple[int, int, int, Comm]]] = defaultdict(list)
    for (src, dst), msgs in sorted(channel.items()):
        if any(msg not in need for msg in msgs):
            missing = next(msg for msg in msgs if msg not in need)
            raise ValueError(
                f"rank {src} sends {missing} to rank {dst}, which never consumes it; "
                "validate the schedule first"
            )
        latest = len(schedule.actions[dst])
        for seq in range(len(msgs) - 1, -1, -1):
            msg = msgs[seq]
            latest = min(latest, max(0, need[msg] - lookahead))
            op = CommOp.RECV_F if msg.dir is Dir.F else CommOp.RECV_B
            posted_at[dst].append((latest, src, seq, Comm(msg.consumer, op, msg.mb, src)))
    sent = {msg for msgs in channel.values() for msg in msgs}
    for msg in need:
        if msg not in sent:
            raise ValueError(
                f"stage {msg.consumer} needs {msg} from rank {owner[msg.stage]}, which never "
                "sends it; validate the schedule first"
            )
    # by slot, then channel order
    return [[(t[0], t[3]) for t in sorted(posted_at[r], key=lambda t: t[:3])]
            for r in range(schedule.num_ranks)]
