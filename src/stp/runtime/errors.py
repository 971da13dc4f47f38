"""Errors the runtime raises, worded for people, and the exit statuses they map to.

A distributed failure is only useful if it says who was waiting for whom: a
rank that blocks on a receive or a collective past the timeout raises
`CommTimeout` naming itself (global rank and mesh coordinates), the action
it was executing and the peer (or group) it was waiting for; a rank whose
peer closed the connection (the peer crashed, was killed or left) raises
`PeerLost`, saying how long it had waited. Every other failure inside an
action is re-raised as `RankError` with the same context. One function,
`wrap`, turns a backend error into the one of the three it is, for the
executor, the point-to-point transfers and the trainer's collectives alike.

Exit statuses let a launcher tell a cause from its consequences: a rank
that failed by itself exits `EXIT_FAILED`; a rank that only waited on a
peer that timed out or went away exits `EXIT_PEER`, so the launcher looks
for the rank those were waiting on.
"""

from __future__ import annotations

import re
from typing import Literal

import torch.distributed as dist

__all__ = [
    "RankError", "CommTimeout", "PeerLost", "FailureKind", "failure_kind", "is_timeout",
    "first_line", "wrap", "exit_status", "EXIT_FAILED", "EXIT_PEER",
]

EXIT_FAILED = 1
"""This rank failed by itself (an error in its own work)."""
EXIT_PEER = 3
"""This rank stopped because a peer timed out or went away: a consequence, not a cause."""


class RankError(RuntimeError):
    """A failure on one rank while running one action.

    `where` names the rank and its mesh coordinates, `action` the action
    being executed (e.g. `2RECV_F3`, `1F3`, `DP all-reduce`).
    """

    def __init__(self, message: str, *, where: str = "", action: str = "") -> None:
        parts = [p for p in (where, f"in {action}" if action else "") if p]
        super().__init__((" ".join(parts) + ": " if parts else "") + message)
        self.where, self.action = where, action


class CommTimeout(RankError):
    """A rank waited on a receive or a collective longer than the timeout (or,
    where the backend cannot tell, until the peer went away)."""


class PeerLost(CommTimeout):
    """A peer closed the connection while this rank waited on it: the peer's
    process ended (crashed, killed, or stopped after its own failure)."""


FailureKind = Literal["timeout", "peer_lost", "other"]

# Messages torch's backends use (gloo's tcp transport, NCCL's watchdog, the store).
_PEER_LOST_MARKERS = ("connection closed", "connection reset", "pair closure", "broken pipe",
                      "connection refused", "socket closed", "communicator was aborted")
_TIMEOUT_MARKERS = ("timed out", "timeout")


def failure_kind(err: BaseException) -> FailureKind:
    """Whether a backend error is a timeout, a peer that went away, or neither.

    torch's typed errors come first (a `DistNetworkError` is a broken
    connection); the backends raise plain RuntimeErrors for both cases, so
    their message text decides after that.
    """
    if isinstance(err, dist.DistNetworkError):
        return "peer_lost"
    text = str(err).lower()
    if any(m in text for m in _PEER_LOST_MARKERS):
        return "peer_lost"
    if any(m in text for m in _TIMEOUT_MARKERS):
        return "timeout"
    return "other"


def is_timeout(err: BaseException) -> bool:
    """True if `err` looks like a backend timeout or a peer that went away."""
    return failure_kind(err) != "other"


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")
# gloo appends advice (and an emoji) to "Connection closed by peer [addr]:port.".
_ADVICE = re.compile(r"\.?\s+This is typically caused by.*$")


def first_line(err: BaseException) -> str:
    """The first line of a backend error, without gloo's `[file.cc:123]` prefix,
    its advice trailer, or characters outside ASCII."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = _SOURCE_PREFIX.sub("", text.splitlines()[0])
    line = _ADVICE.sub("", line).encode("ascii", "ignore").decode().strip()
    return line or type(err).__name__


def wrap(
    err: BaseException, *, where: str, action: str, peers: str, awaiting: str = "",
    waited: float | None = None, timeout: float | None = None,
) -> RankError:
    """The rank error for backend error `err` (not itself a RankError), raised while
    this rank (`where`) ran `action` waiting on `peers`.

    `peers` is the subject of a sentence: "pipeline rank 1 (global rank 1, stage
    1)", "a rank in the world". `awaiting` says what this rank waited for from
    them ("data"), `waited` for how long, `timeout` the limit it waited under;
    each is left out of the message when not given (a collective's limit is its
    process group's, which the caller may not know). A peer that went away is
    `PeerLost` (a consequence of that peer's end, whoever waited on it), a
    timeout `CommTimeout`, anything else this rank's own `RankError` worded by
    the backend's first line.
    """
    first = first_line(err)
    kind = failure_kind(err)
    if kind == "peer_lost":
        spent = "" if waited is None else f" after {waited:.1f} s"
        if spent and awaiting:
            spent += f" of waiting for {awaiting}"
        return PeerLost(f"{peers} closed the connection{spent}: that process ended ({first})",
                        where=where, action=action)
    if kind == "timeout":
        target = f"{awaiting} from {peers}" if awaiting else peers
        if timeout is None:
            return CommTimeout(f"timed out waiting for {target} ({first})",
                               where=where, action=action)
        return CommTimeout(f"waited more than {timeout:g} s for {target} ({first})",
                           where=where, action=action)
    return RankError(first, where=where, action=action)


def exit_status(err: BaseException) -> int:
    """The exit status of a rank that stops on `err` (see the module doc): a raw
    backend error counts as waiting on a peer when it is a timeout or a lost peer."""
    if isinstance(err, CommTimeout):
        return EXIT_PEER
    if isinstance(err, RankError) or not isinstance(err, RuntimeError):
        return EXIT_FAILED
    return EXIT_PEER if failure_kind(err) != "other" else EXIT_FAILED
