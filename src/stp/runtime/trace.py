"""Measured traces: what the runtime did, in the simulator's shape (stp.sim.result.Span).

A `Recorder` on each rank collects, for one run of the executor:

* compute lane: every unit's compute (`7F3`, kind F/B/W, unit = index of the
  transformer unit in the stage, None for the embedding and loss units),
  from after any wait to its end; units of one action share `action_index`;
* tp lane: every TP collective, named by its kind: `AR` an all-reduce, and
  under sequence parallelism (stp.models.tp.sequence) `RS` the
  reduce-scatter that ends a unit and `AG` the all-gather that starts one;
  `A2A` an expert all-to-all (a stage's unit hands the runner a partial whose
  `collective` names it, launched and waited for like an all-reduce).
  An all-reduce or reduce-scatter runs from its launch to its completion
  (the work's completion callback where the backend has one, else when first
  seen complete); an all-gather from its launch to when the compute stream
  took its result (its unit's start, or under an advance of
  stp.runtime.braid the later unit that reads it), so a gather hidden under
  the partner's unit spans that unit;
* send lane: every send and receive (`1SEND_F3`, `2RECV_B1`, kind SEND /
  RECV) from its posting to its completion as seen by the receiver: a receive
  ends when the executor's wait for it returns (right before the pass that
  needs it, so at or after the data arrived); a send ends when its receive
  does (matched across ranks in `gather_spans`; gloo reports a point-to-point
  work complete only to `wait`, and the sender waits only at the end of the
  step);
* dp lane: every data-parallel gradient reduction the trainer launched
  (stp.train.step.grad_sync; kind `DP-AR` an all-reduce, `DP-RS` the sharded
  optimizer's reduce-scatter), named after the stage whose gradients it
  carries, from its launch to its completion (as an all-reduce above):
  launched when the stage's last gradient pass ends, it runs under the
  compute of the passes still to come; and with the sharded optimizer's
  `overlap_param_gather` (stp.train.step.param_gather) every parameter all-gather
  (kind `DP-AG`), recorded in the step whose forward waited for it, from its
  launch after the last optimizer step (at the earliest this run's start) to
  its completion.

Events of one lane must nest (trace viewers drop overlapping ones), so a
span that would end after the span it starts inside is drawn from that
span's end (`lane_layout`): all-reduces of a rank complete in launch order,
so the tp lane shows each from its launch or the previous one's completion,
whichever is later, the lane's occupancy as the simulator draws it.

Times are host times (`time.perf_counter`). On CUDA a compute span would be
the host's enqueue of the unit unless the stream were synchronised; this
project's CI has no GPU, so only CPU (gloo) traces are tested.

`gather_spans` brings every rank's spans to global rank 0 on one time axis
(zero = the earliest run start; `time.perf_counter` is one clock for all the
processes of a machine); `write_trace` writes them in stp.sim.trace_format, so a
measured run and a simulated one open side by side in ui.perfetto.dev.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from stp.runtime.stage_api import UnitStage
from stp.schedule.ir import Pass, Schedule
from stp.schedule.lower import Message
from stp.sim.result import Span
from stp.sim.trace_format import trace_document, trace_events, write_trace_document

__all__ = ["Recorder", "TransferRecord", "Watched", "gather_spans", "write_trace",
           "lane_layout"]


class Watched:
    """A collective in flight as a Recorder watches it: launched at `launched`,
    complete at `done_at` (None: not seen complete yet)."""

    __slots__ = ("launched", "done_at")

    def __init__(self, launched: float) -> None:
        self.launched = launched
        self.done_at: float | None = None

    def done(self, now: float) -> None:
        """Seen complete at `now` (the earliest sighting wins)."""
        self.done_at = now if self.done_at is None else min(self.done_at, now)


def _stamp_on_completion(work: Any, watched: Any) -> None:
    """Stamp `watched.done_at` from the work's completion callback, where the
    backend has one (else whoever waits for it stamps it)."""
    try:
        fut = work.get_future()
    except (AttributeError, RuntimeError):
        return

    def stamp(_: Any) -> None:
        now = time.perf_counter()
        watched.done_at = now if watched.done_at is None else min(watched.done_at, now)

    fut.then(stamp)


class TransferRecord(NamedTuple):
    """One send or receive as the recorder saw it."""

    kind: str
    """SEND or RECV."""
    name: str
    stage: int
    mb: int
    chunk: int
    posted: float
    end: float
    """When this rank saw it complete."""
    peer: int
    """Global rank at the other end."""
    message: Message
    """(direction, producing stage, mb): the same on both ends."""


class Recorder:
    """Spans of one rank (global rank `rank`); `chunk_of[stage]` for labels."""

    def __init__(self, rank: int, chunk_of: Mapping[int, int] | Sequence[int]) -> None:
        self.rank = rank
        self.chunk_of = chunk_of
        self.origin = 0.0
        self._spans: list[Span] = []
        self._gathers: list[Span] = []
        self._ars: list[tuple[Any, Pass, tuple[int | None, str | None], int, bool, str]] = []
        self._xfers: list[TransferRecord] = []
        self._dp: list[tuple[Watched, str, str, int]] = []
        self._layer_index: dict[int, list[tuple[int | None, str | None]]] = {}

    def start(self) -> None:
        """Forget the previous run; times count from now."""
        self.origin = time.perf_counter()
        self._spans, self._gathers, self._ars, self._xfers = [], [], [], []
        self._dp = []

    def _unit_index(self, stage: UnitStage, u: int) -> tuple[int | None, str | None]:
        """(index of unit u among the stage's transformer units, its name), (None,
        None) for the embedding and loss units. The name labels the span: layers
        differ in their units (an MoE layer under expert parallelism has four)."""
        table = self._layer_index.get(id(stage))
        if table is None:
            table, k = [], 0
            for unit in stage.units:
                name = str(getattr(unit, "name", "layers."))
                layer = name.startswith("layers.")
                table.append((k, name) if layer else (None, None))
                k += layer
            self._layer_index[id(stage)] = table
        return table[u]

    def unit(self, p: Pass, kind: str, stage: UnitStage, u: int, start: float, end: float,
             index: int, braided: bool) -> None:
        unit, label = self._unit_index(stage, u)
        self._spans.append(Span(self.rank, "compute", start, end, str(p), kind, p.stage, p.mb,
                                self.chunk_of[p.stage], unit, index, braided, label))

    def allreduce(self, ar: Any, p: Pass, stage: UnitStage, u: int, index: int, braided: bool,
                  kind: str = "AR") -> None:
        """Watch all-reduce `ar` (stp.runtime.braid) of unit u of pass p; `kind` "RS":
        the reduce-scatter that replaces it under sequence parallelism."""
        self._ars.append((ar, p, self._unit_index(stage, u), index, braided, kind))
        _stamp_on_completion(ar.work, ar)  # no callback: the executor's polls stamp it

    def reduction(self, work: Any, name: str, kind: str, stage: int,
                  launched: float) -> Watched:
        """Watch a data-parallel collective (kind DP-AR / DP-RS, or DP-AG a parameter
        all-gather) of `stage`'s gradients (parameters), launched at `launched`;
        whoever waits for it calls `done`."""
        watched = Watched(launched)
        self._dp.append((watched, name, kind, stage))
        if work is not None:
            _stamp_on_completion(work, watched)
        else:
            watched.done(launched)
        return watched

    def gather(self, p: Pass, stage: UnitStage, u: int, start: float, end: float, index: int,
               braided: bool) -> None:
        """An all-gather unit u of pass p ran and waited for on the compute stream
        (sequence parallelism: the start of a TP region, stp.models.tp.sequence)."""
        unit, label = self._unit_index(stage, u)
        self._gathers.append(Span(self.rank, "tp", start, end, str(p), "AG", p.stage, p.mb,
                                  self.chunk_of[p.stage], unit, index, braided, label))

    def transfer(self, name: str, kind: str, stage: int, mb: int, start: float, end: float,
                 peer: int, message: Message) -> None:
        """A send or receive (kind SEND / RECV) of `message` with global rank `peer`."""
        self._xfers.append(TransferRecord(kind, name, stage, mb, self.chunk_of[stage], start, end,
                                    peer, message))

    def spans(self) -> list[Span]:
        """This run's spans (absolute perf_counter seconds), lanes made to nest (the tp
        lane's all-reduces, reduce-scatters and all-gathers together)."""
        ars = []
        for ar, p, (unit, label), index, braided, kind in self._ars:
            done = ar.done_at if ar.done_at is not None else ar.launched
            ars.append(Span(self.rank, "tp", ar.launched, done, str(p), kind, p.stage, p.mb,
                            self.chunk_of[p.stage], unit, index, braided, label))
        dp = [Span(self.rank, "dp", w.launched, w.done_at if w.done_at is not None
                   else w.launched, name, kind, stage, 0, self.chunk_of[stage])
              for w, name, kind, stage in self._dp]
        return self._spans + lane_layout(ars + self._gathers) + lane_layout(dp)

    def transfers(self) -> list[TransferRecord]:
        return list(self._xfers)


def lane_layout(spans: list[Span]) -> list[Span]:
    """Spans of one lane made to nest, as trace viewers require (Perfetto drops
    events that overlap without nesting): a span that would end after the span
    it starts inside is started when that one ends instead."""
    heap = [(s.start, -s.end, i) for i, s in enumerate(spans)]
    heapq.heapify(heap)
    out: list[Span] = []
    ends: list[float] = []  # ends of the open spans, innermost last
    while heap:
        start, neg_end, i = heapq.heappop(heap)
        while ends and ends[-1] <= start:
            ends.pop()
        if ends and -neg_end > ends[-1]:
            heapq.heappush(heap, (ends[-1], neg_end, i))  # after the one it overlaps
            continue
        ends.append(-neg_end)
        out.append(dataclasses.replace(spans[i], start=start))
    return out


def gather_spans(recorder: Recorder, group: dist.ProcessGroup | None = None) -> list[Span] | None:
    """Every rank's spans on global rank 0 of `group` (None elsewhere), in seconds
    from the earliest run start. Collective: every rank of the group calls it."""
    mine = (recorder.rank, recorder.origin, recorder.spans(), recorder.transfers())
    world = dist.get_world_size(group)
    out: list[Any] | None = [None] * world if dist.get_rank(group) == 0 else None
    dist.gather_object(mine, out, dst=dist.get_global_rank(group, 0) if group else 0,
                       group=group)
    if out is None:
        return None
    zero = min(origin for _, origin, _, _ in out)
    received = {(rank, x.peer, x.message): x.end for rank, _, _, xs in out
                for x in xs if x.kind == "RECV"}
    spans = [s for _, _, sp, _ in out for s in sp]
    for rank, _, _, xs in out:
        lane = []
        for x in xs:
            end = x.end
            if x.kind == "SEND":  # complete when its receive was
                end = max(x.posted, min(end, received.get((x.peer, rank, x.message), end)))
            lane.append(Span(rank, "send", x.posted, end, x.name, x.kind, x.stage, x.mb,
                             x.chunk))
        spans += lane_layout(lane)
    return [dataclasses.replace(s, start=s.start - zero, end=s.end - zero) for s in spans]


def write_trace(
    path: str | Path,
    spans: list[Span],
    schedule: Schedule,
    pp_rank_of: Mapping[int, int],
    meta: Mapping[str, object] | None = None,
) -> None:
    """Write measured `spans` as a Chrome / Perfetto trace (stp.sim.trace_format,
    times in seconds shown as such). `pp_rank_of[rank]` names each rank's actions
    from the schedule."""
    names = {
        (r, i): str(a)
        for r, pp in pp_rank_of.items() for i, a in enumerate(schedule.actions[pp])
    }
    doc = trace_document(
        trace_events(spans, action_names=names, time_scale=1e6),
        {
            "source": "stp runtime (measured)",
            "schedule": schedule.name,
            "pp": schedule.num_ranks,
            "microbatches": schedule.num_microbatches,
            "chunks": schedule.chunks,
            "time_scale_us_per_unit": 1e6,
            "pp_rank_of_rank": {str(r): pp for r, pp in pp_rank_of.items()},
            **dict(meta or {}),
        },
    )
    write_trace_document(path, doc)
