"""Where the simulator's timed pieces of work go: a list of spans, or nowhere.

The engine reports every unit, all-reduce, send and offload copy to a sink
and never asks whether anyone listens; `SpanRecorder` turns the reports into
`Span`s (the timeline the pictures and traces read), `NoSpans` drops them
(a search simulating thousands of candidates needs only the totals).
"""

from __future__ import annotations

from typing import Protocol

from stp.schedule.ir import Kind, Pass, Schedule
from stp.sim.result import Span
from stp.sim.units import Item, UnitKind

__all__ = ["SpanSink", "SpanRecorder", "NoSpans"]

_LABEL = {kind: kind.value for kind in UnitKind}
"""A compute span's kind as a plain string (a lookup: `.value` on an enum
member is a Python-level property, and this runs once per unit)."""


class SpanSink(Protocol):
    """Receives the simulator's work as it is timed, action by action. A
    `chain` is the index of a pass within the current action."""

    def action(self, rank: int, index: int, passes: tuple[Pass, ...]) -> None:
        """What follows belongs to the action at position `index` of `rank`'s
        list, which runs `passes` (braided when there are several)."""

    def unit(self, item: Item, start: float, end: float) -> None: ...

    def allreduce(self, item: Item, start: float, end: float, kind: str = "AR") -> None:
        """The TP collective next to unit `item`: the all-reduce that ends it, or
        with sequence parallelism its reduce-scatter and the next unit's
        all-gather (`RS+AG`), the pass's last reduce-scatter (`RS`) or the
        all-gather before its first unit (`AG`)."""

    def sent(self, chain: int, at: float) -> None:
        """The pass's output leaves at `at`."""

    def offload(self, chain: int, start: float, end: float) -> None:
        """The forward's activations are copied out to the host."""

    def reload(self, stage: int, mb: int, start: float, end: float) -> None:
        """Activations of (stage, mb) are copied back, issued at this action."""


class NoSpans:
    """A sink that keeps nothing."""

    def action(self, rank: int, index: int, passes: tuple[Pass, ...]) -> None:
        pass

    def unit(self, item: Item, start: float, end: float) -> None:
        pass

    def allreduce(self, item: Item, start: float, end: float, kind: str = "AR") -> None:
        pass

    def sent(self, chain: int, at: float) -> None:
        pass

    def offload(self, chain: int, start: float, end: float) -> None:
        pass

    def reload(self, stage: int, mb: int, start: float, end: float) -> None:
        pass


class SpanRecorder:
    """Collects `Span`s in report order on the lanes of `stp.sim.result.LANES`."""

    def __init__(self, schedule: Schedule, comm: float) -> None:
        self.spans: list[Span] = []
        self._chunk_of = [schedule.chunk_of(s) for s in range(schedule.num_stages)]
        self._owner = schedule.stage_to_rank
        self._comm = comm
        self._rank = self._index = -1
        self._passes: tuple[Pass, ...] = ()
        self._names: list[str] = []
        self._braided = False

    def action(self, rank: int, index: int, passes: tuple[Pass, ...]) -> None:
        self._rank, self._index, self._passes = rank, index, passes
        self._names = [str(p) for p in passes]
        self._braided = len(passes) > 1

    def unit(self, item: Item, start: float, end: float) -> None:
        p = self._passes[item.chain]
        self.spans.append(Span(self._rank, "compute", start, end, self._names[item.chain],
                               _LABEL[item.kind], p.stage, p.mb, self._chunk_of[p.stage],
                               item.unit, self._index, self._braided))

    def allreduce(self, item: Item, start: float, end: float, kind: str = "AR") -> None:
        p = self._passes[item.chain]
        self.spans.append(Span(self._rank, "tp", start, end, self._names[item.chain], kind,
                               p.stage, p.mb, self._chunk_of[p.stage], item.unit, self._index,
                               self._braided))

    def sent(self, chain: int, at: float) -> None:
        """A span of the send latency when the output goes to another rank (a
        forward's to the next stage, a backward's input gradient to the
        previous one); a W sends nothing."""
        p = self._passes[chain]
        if self._comm <= 0 or p.kind is Kind.W:
            return
        nxt = p.stage + 1 if p.kind is Kind.F else p.stage - 1
        if 0 <= nxt < len(self._owner) and self._owner[nxt] != self._rank:
            self.spans.append(Span(self._rank, "send", at, at + self._comm, self._names[chain],
                                   "SEND", p.stage, p.mb, self._chunk_of[p.stage], None,
                                   self._index, self._braided))

    def offload(self, chain: int, start: float, end: float) -> None:
        p = self._passes[chain]
        self.spans.append(Span(self._rank, "d2h", start, end, f"{p.stage}OFFLOAD{p.mb}", "D2H",
                               p.stage, p.mb, self._chunk_of[p.stage], None, self._index))

    def reload(self, stage: int, mb: int, start: float, end: float) -> None:
        self.spans.append(Span(self._rank, "h2d", start, end, f"{stage}RELOAD{mb}", "H2D",
                               stage, mb, self._chunk_of[stage], None, self._index))
