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


def unit_collectives(ag: float, rs: float, ar: float, ag_forward: float, ar_forward: float,
                     kind: UnitKind) -> tuple[float, float]:
    """(gather before, scatter after) a unit of `kind`: its all-gather and
    reduce-scatter, an all-reduce split into its two halves; a W unit gathers
    its forward's input again (the forward's gather) and scatters nothing."""
    if kind is _W:
        return ag_forward + ar_forward / 2, 0.0
    return ag + ar / 2, rs + ar / 2


ChainStart = Callable[[RankLanes, Pass, float, float], tuple[float, float]]
"""(rank, pass, lane free, input arrival) -> (when its first unit may start, a
gather wait): the engine's rule for a pass's start (reloads included)."""


def run_chunked(table: StageTable, sink: SpanSink, plan: InLayer, chain_start: ChainStart,
                rank: RankLanes, p: Pass, items: tuple[Item, ...],
                ready: float) -> tuple[float, float]:
    """Run pass `p` (its `items` in its own order) chunked on `rank`'s lanes;
    returns (when its first unit may start, when its output is final)."""
    st = p.stage
    times, ars, ags, rss, a2as = (table.unit_time[st], table.ar_time[st], table.ag_time[st],
                                  table.rs_time[st], table.a2a_time[st])
    record = not isinstance(sink, NoSpans)
    t, start = rank.lane, -1.0
    for it in items:
        kind = it.kind
        if it.first:
            base, _ = chain_start(rank, p, t, ready)
            comm0 = max(ready, rank.tp)
        else:
            base = comm0 = t
        a, r = unit_collectives(ags[kind], rss[kind], ars[kind], ags[_F], ars[_F], kind)
        line = chunk_timeline(base, comm0, times[kind], a, r, plan, record)
        if start < 0:
            start = base
        rank.busy += line.busy
        rank.tp_total += line.comm
        rank.tp_wait += line.end - base - line.busy
        for what, s, e in line.pieces:
            if what == "G":
                sink.unit(it, s, e)
            else:
                sink.allreduce(it, s, e, what)
        end = line.end
        a2a = a2as[kind]
        if a2a > 0:
            rank.a2a_total += a2a
            rank.a2a_wait += a2a
            sink.allreduce(it, end, end + a2a, "A2A")
            end += a2a
        t = end
        rank.tp = max(rank.tp, end)
    rank.lane = t
    return start, t
