"""A pass on its own with in-layer TP overlap: each unit timed chunk by chunk.

`stp.sim.engine` calls `run_chunked` for every pass that runs alone when the
simulation has an `InLayer` plan; each unit's all-gather, compute and
reduce-scatter become the chunk pipeline of `stp.sim.inlayer`, and units run
one after another (the next unit's input is this unit's reduced output). A
unit's all-to-all (expert parallelism) is not chunked: it follows the unit
on the TP lane and the next unit waits for it, as in a pass without overlap.
"""

from __future__ import annotations

from collections.abc import Callable

from stp.schedule.ir import Pass
from stp.sim.inlayer import InLayer, chunk_timeline
from stp.sim.rank_lanes import RankLanes
from stp.sim.spans import NoSpans, SpanSink
from stp.sim.table import StageTable
from stp.sim.units import Item, UnitKind

__all__ = ["run_chunked", "unit_collectives"]

_F, _W = UnitKind.F, UnitKind.W


def unit_collectives(ag: float, rs: float, ar: float, ag_forward: float,
                     kind: UnitKind) -> tuple[float, float]:
    """(gather before, scatter after) a unit of `kind`: its all-gather, and its
    reduce-scatter or (without sequence parallelism) its all-reduce, each chunk's
    after the chunk's matmuls; a W unit gathers its forward's input again (the
    forward's gather; nothing without sequence parallelism, which keeps the whole
    input) and scatters nothing."""
    if kind is _W:
        return ag_forward, 0.0
    return ag, rs + ar


ChainStart = Callable[[RankLanes, Pass, float, float], tuple[float, float]]
"""(rank, pass, lane free, input arrival) -> (when its first unit may start, a
gather wait): the engine's rule for a pass's start (reloads included)."""


def run_chunked(table: StageTable, sink: SpanSink, plan: InLayer, chain_start: ChainStart,
                rank: RankLanes, p: Pass, items: tuple[Item, ...],
                ready: float) -> tuple[float, float]:
    """Run pass `p` (its `items` in its own order) chunked on `rank`'s lanes;
    returns (when its first unit may start, when its output is final).

    An F or B unit waits for the previous one's output (its last scatter and
    any all-to-all); a W unit waits only for the compute lane, so in a full
    backward B's last scatter pieces run under the W unit that follows, as
    without overlap. The pass ends when its last collective does (plain TP
    code waits for it)."""
    st = p.stage
    times, ars, ags, rss, a2as = (table.unit_time[st], table.ar_time[st], table.ag_time[st],
                                  table.rs_time[st], table.a2a_time[st])
    record = not isinstance(sink, NoSpans)
    lane, tp, start = rank.lane, rank.tp, -1.0
    out = scattered = ready  # the chain's latest output final / its scatter ended
    for it in items:
        kind = it.kind
        if it.first:
            base, _ = chain_start(rank, p, lane, ready)
            comm0 = ready  # launched on arrival, beside the lane's queue (stp.sim.engine)
        elif it.waits_ar:  # its input is the previous unit's reduced output
            base = max(lane, out)
            in_a2a = max(0.0, base - max(lane, scattered))
            rank.a2a_wait += in_a2a
            rank.tp_wait += base - lane - in_a2a
            comm0 = max(out, tp)
        else:
            base, comm0 = lane, max(lane, tp)
        a, r = unit_collectives(ags[kind], rss[kind], ars[kind], ags[_F], kind)
        line = chunk_timeline(base, comm0, times[kind], a, r, plan, record)
        if start < 0:
            start = base
        rank.busy += line.busy
        rank.tp_total += line.comm
        rank.tp_wait += line.compute_end - base - line.busy
        for what, s, e in line.pieces:
            if what == "G":
                sink.unit(it, s, e)
            else:
                sink.allreduce(it, s, e, what)
        lane, tp = line.compute_end, max(tp, line.comm_end)
        if kind is not _W:
            scattered = out = line.end
            a2a = a2as[kind]
            if a2a > 0:
                rank.a2a_total += a2a
                sink.allreduce(it, line.end, line.end + a2a, "A2A")
                out = tp = line.end + a2a
    end = max(lane, out)
    in_a2a = max(0.0, end - max(lane, scattered))
    rank.a2a_wait += in_a2a
    rank.tp_wait += end - lane - in_a2a
    rank.lane, rank.tp = end, tp
    return start, end
