"""Errors the runtime raises, worded for people.

A distributed failure is only useful if it says who was waiting for whom: a
rank that blocks on a receive or a collective past the timeout raises
`CommTimeout` naming itself (global rank and mesh coordinates), the action
it was executing and the peer (or group) it was waiting for. Every other
failure inside an action is re-raised as `RankError` with the same context.
"""

from __future__ import annotations

import re

__all__ = ["RankError", "CommTimeout", "is_timeout", "first_line"]


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
    """A rank waited on a receive or a collective longer than the timeout."""


# Messages torch's backends use for a timed-out or torn-down operation.
_TIMEOUT_MARKERS = ("timed out", "timeout", "pair closure", "connection closed", "connection reset")


def is_timeout(err: BaseException) -> bool:
    """True if `err` looks like a backend timeout or a peer that went away."""
    text = str(err).lower()
    return any(m in text for m in _TIMEOUT_MARKERS)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


def first_line(err: BaseException) -> str:
    """The first line of a backend error, without gloo's `[file.cc:123]` prefix."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    return _SOURCE_PREFIX.sub("", text.splitlines()[0]) or type(err).__name__
