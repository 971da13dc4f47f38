"""Discrete-event simulation of a schedule: compute, TP all-reduce, sends, memory.

Model (one rank; every rank of a TP group does the same, so one stands for all):

* compute lane: runs the rank's actions in list order, each action's units in
  `braid()` order, one unit at a time.
* TP lane: each F or B unit ends in an all-reduce of `ar / v / U` (its share
  of one pass's all-reduce time); all-reduces run one at a time, in issue
  order. The next F/B unit of the same pass waits for it (its input is the
  reduced tensor).
* A pass on its own waits for each of its all-reduces, as plain TP code does,
  including the last one before the action ends. In a braided block all
  all-reduces are asynchronous: the stream waits only where a unit needs a
  result, so the block's last all-reduce may run under the next action.
  In a full backward the W unit needs only its B unit's input, not its
  all-reduce, so `AR(B_u)` runs under `W_u`. Nothing else overlaps: these
  rules alone give the TP-bubble column of the table of "Synergistic Tensor
  and Pipeline Parallelism" (arXiv 2510.27257): `2m T_AR` for interleaved
  1F1B, `4m T_AR` for ZB-V, `(2p+1) T_AR` for STP.
* sequence parallelism (`ag`, `rs` > 0; Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
  section 4.2.2): each F or B unit starts with an all-gather (before its
  column-parallel linears; in B, of the output gradient) and ends with a
  reduce-scatter (after its row-parallel linears; in B, of the input
  gradient), `ag / v / U` and `rs / v / U` each. Between two units of one
  pass the reduce-scatter and the next unit's all-gather run back to back on
  the TP lane where the all-reduce ran (the norm between them is folded into
  the units), so the braid rule is unchanged: the next unit waits for them.
  A pass's first all-gather is launched when its input arrives (the runtime
  starts it when the receive completes) and delays only that pass's first
  unit; it is not queued behind the rank's other collectives, which are
  issued at unit ends while the rank computes. Its wait counts as exposed TP
  time. The last reduce-scatter ends the pass, as the last all-reduce did.
  Megatron-LM gathers a column-parallel linear's input once more in the
  backward for its weight gradient (it keeps only the s/t shard); that
  all-gather is not charged.
* expert parallelism (`a2a` > 0): an MoE layer runs two all-to-alls in F
  (dispatch each token to its top-k experts' ranks, combine the results
  back) and their duals in B, so each F or B unit ends with one, `a2a / v /
  U`, on the same lane after the unit's TP collective (the router between
  the attention all-reduce and the dispatch is folded into the unit). The
  next unit of the pass waits for it, so the braid rule hides it exactly as
  it hides the all-reduce ("DeepSeek-V3 Technical Report", arXiv 2412.19437,
  section 3.2.1: DualPipe overlaps one microbatch's all-to-alls with
  another's compute); a pass on its own exposes it. In B the real layer
  runs the combine's dual before its expert unit, not after the previous
  unit: the same count and bytes per pass, one unit earlier. A wait that
  ends inside an all-to-all counts as exposed all-to-all time, the rest of
  it as exposed TP time.
* sends: a pass's output leaves when its last all-reduce ends and arrives
  `comm` later on another rank; same-rank hand-offs (the V tip) are free.
* memory: an action allocates its forwards' activations when it starts and
  releases its backwards' when it ends (`stp.schedule.memory`).
* offload (optional `OffloadPlan`): an offloaded forward's activations are
  copied out on the rank's device-to-host lane right after the forward and
  stop counting when that copy ends; the copy back runs on the host-to-device
  lane from when the stream reaches the plan's reload position (and the copy
  out has ended) and counts from its start; the backward waits for it.

Accounting per rank: `exposed_tp` is compute-lane time spent waiting on an
all-reduce beyond any wait for pipeline data, `exposed_a2a` on an
all-to-all; `idle` (the PP bubble) is the
rest of the span not spent computing.
"""

from __future__ import annotations

from stp.schedule.ir import Action, Kind, Pass, Schedule, passes_of
from stp.schedule.memory import MemCosts
from stp.schedule.offload import OffloadPlan
from stp.schedule.validate import ScheduleError
from stp.sim.costs import Costs, OffloadCosts
from stp.sim.inlayer import InLayer, mode_name
from stp.sim.lone import run_chunked
from stp.sim.rank_lanes import RankLanes, memory_curves
from stp.sim.result import SimResult
from stp.sim.spans import NoSpans, SpanRecorder, SpanSink
from stp.sim.stages import StageCosts
from stp.sim.table import stage_table
from stp.sim.units import Item, braid_counts

__all__ = ["simulate"]

_F = Kind.F  # bound once: an enum member lookup is slow and this runs per pass

def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    mem: MemCosts | None = None,
    layers: int = 1,
    *,
    offload: OffloadPlan | None = None,
    offload_costs: OffloadCosts | None = None,
    record_spans: bool = True,
    stages: StageCosts | None = None,
    braid: bool = True,
    in_layer: InLayer | None = None,
) -> SimResult:
    """Simulate `schedule` under `costs` (per microbatch, per rank share).

    The schedule must be valid (`stp.schedule.validate`); a deadlock is still
    detected and raised as ScheduleError. `layers` is transformer layers per
    chunk: each pass is `2 * layers` units.

    `stages` (`stp.sim.stages`), one entry per global stage, gives every
    stage its own pass times, all-reduces, units, activation memory and the
    send latency; `costs`, `mem` and `layers` are then only reported (`costs`
    defaults to the table's average rank share).

    `braid=False` runs a block's passes one after another, each as a pass on
    its own; `in_layer` chunks every pass that runs on its own
    (`stp.sim.inlayer`: in-layer TP overlap; with `braid` the hybrid).
    """
    if stages is not None and costs is None:
        costs = stages.mean_costs(schedule.num_ranks)
    costs = costs or Costs()
    mem = mem or MemCosts()
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r} must be an integer >= 1")
    comm = costs.comm if stages is None else stages.comm
    recorder = SpanRecorder(schedule, comm) if record_spans else None
    sim = _Simulation(schedule, costs, mem, layers, offload, offload_costs or OffloadCosts(),
                      recorder or NoSpans(), stages)
    sim.braid, sim.in_layer = braid, in_layer
    sim.run()
    memory, peak = memory_curves([rank.mem_events for rank in sim.ranks])
    return SimResult(
        schedule=schedule,
        costs=costs,
        mem=mem,
        layers=layers,
        makespan=max((rank.last_end for rank in sim.ranks), default=0.0),
        mode=mode_name(braid, in_layer),
        in_layer=in_layer,
        ranks=[rank.stats(peak[rank.index]) for rank in sim.ranks],
        spans=recorder.spans if recorder else [],
        memory=memory,
        offload=offload,
        stages=stages,
    )


class _Simulation:
    """The state of one run: every rank's lanes and the results produced so
    far. `run` sweeps the ranks in order, each running as many actions as have
    their inputs, until none can move."""

    def __init__(self, schedule: Schedule, costs: Costs, mem: MemCosts, layers: int,
                 offload: OffloadPlan | None, oc: OffloadCosts, sink: SpanSink,
                 stages: StageCosts | None = None) -> None:
        self.sink = sink
        self.braid, self.in_layer = True, None  # type: tuple[bool, InLayer | None]
        self.chunks = schedule.chunks
        self.num_stages = schedule.num_stages
        self.table = stage_table(self.num_stages, self.chunks, costs, mem, layers, stages, oc)
        self.comm = costs.comm if stages is None else stages.comm
        self.owner = schedule.stage_to_rank
        self.done: dict[tuple[int, Kind, int], float] = {}
        """(stage, kind, mb) of a result (the shape of a `Done` key) -> when it
        is ready on its own rank."""
        self.ranks = [RankLanes(r, acts) for r, acts in enumerate(schedule.actions)]
        self.offloaded = offload.reload_at if offload else {}
        self.copied_out: dict[tuple[int, int], float] = {}
        self.reload_ready: dict[tuple[int, int], float] = {}
        for key, pos in self.offloaded.items():
            self.ranks[self.owner[key[0]]].reloads_at.setdefault(pos, []).append(key)

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                while rank.next < len(rank.actions):
                    if rank.waiting is not None and rank.waiting not in self.done:
                        break  # still blocked on what stopped it last sweep
                    action = rank.actions[rank.next]
                    ready = self._arrivals(passes_of(action), rank)
                    if ready is None:
                        break
                    rank.next += 1
                    self._run_action(rank, rank.next - 1, action, ready)
                    progress = True
        for rank in self.ranks:
            if rank.next < len(rank.actions):
                raise ScheduleError(
                    "deadlock in simulation (validate the schedule for a diagnosis)",
                    rank.index, rank.next, rank.actions[rank.next],
                )

    def _arrivals(self, passes: tuple[Pass, ...], rank: RankLanes) -> list[float] | None:
        """When each pass's inputs are all on `rank` (None: one is not produced
        yet; `rank.waiting` names it)."""
        out = []
        for p in passes:
            t = 0.0
            for d in p.needs(self.num_stages):
                got = self.done.get(d)
                if got is None:
                    rank.waiting = d
                    return None
                if self.owner[d.stage] != rank.index:
                    got += self.comm
                t = max(t, got)
            out.append(t)
        return out

    def _run_action(self, rank: RankLanes, index: int, action: Action, ready: list[float]) -> None:
        passes = passes_of(action)
        self._reload(rank, index)
        if len(passes) > 1 and not self.braid:
            for p, at in zip(passes, ready, strict=True):  # unbraided: pass by pass
                self._run_passes(rank, index, p, (p,), [at])
            return
        self._run_passes(rank, index, action, passes, ready)

    def _run_passes(self, rank: RankLanes, index: int, action: Action,
                    passes: tuple[Pass, ...], ready: list[float]) -> None:
        """Time `passes` (braided when several) and their memory, send their outputs."""
        self.sink.action(rank.index, index, passes)
        units = self.table.units
        items = braid_counts(action, tuple(units[p.stage] for p in passes))
        if self.in_layer is not None and len(passes) == 1:
            start, end = run_chunked(self.table, self.sink, self.in_layer, self._chain_start,
                                     rank, passes[0], items, ready[0])
            chain_end = [end]
        else:
            start, chain_end = self._compute(rank, passes, items, ready)
        alloc, free = self._memory(passes)
        if alloc:
            rank.mem_events.append((start, alloc))
        if free:
            rank.mem_events.append((rank.lane, -free))
        for c, fin in enumerate(chain_end):
            self._output(rank, c, passes[c], fin)

    def _memory(self, passes: tuple[Pass, ...]) -> tuple[float, float]:
        """(allocated at the start, released at the end) by an action's passes:
        forwards allocate when it starts, backwards release when it ends, so a
        braided block F+B counts both activations at its peak."""
        alloc = free = 0.0
        delta = self.table.delta
        for p in passes:
            d = delta[p.stage][p.kind]
            if d > 0:
                alloc += d
            else:
                free -= d
        return alloc, free

    def _reload(self, rank: RankLanes, index: int) -> None:
        """Issue the copies back that the plan starts when the stream reaches
        action `index` (each also waits for its copy out to end)."""
        for key in sorted(rank.reloads_at.get(index, ())):
            start = max(rank.lane, rank.h2d, self.copied_out[key])
            rank.h2d = start + self.table.copy_time[key[0]]
            self.reload_ready[key] = rank.h2d
            rank.mem_events.append((start, self.table.chunk_act[key[0]]))
            self.sink.reload(key[0], key[1], start, rank.h2d)

    def _compute(self, rank: RankLanes, passes: tuple[Pass, ...], items: tuple[Item, ...],
                 ready: list[float]) -> tuple[float, list[float]]:
        """Run the action's units on the compute lane and their all-reduces on
        the TP lane. Returns when the first unit started and, per pass, when
        its output is final (its last unit and last all-reduce ended)."""
        chain_ar = [0.0] * len(passes)  # end of the chain's last all-reduce
        chain_end = [0.0] * len(passes)
        chain_a2a = [0.0] * len(passes)  # start of the all-to-all ending that collective
        sink = self.sink
        table = self.table
        unit_times = [table.unit_time[p.stage] for p in passes]
        ar_times = [table.ar_time[p.stage] for p in passes]
        ag_times = [table.ag_time[p.stage] for p in passes]
        rs_times = [table.rs_time[p.stage] for p in passes]
        a2a_times = [table.a2a_time[p.stage] for p in passes]
        last_unit = [table.units[p.stage] - 1 if p.kind is _F else 0 for p in passes]
        t, tp, busy, tp_wait, a2a_wait = rank.lane, rank.tp, rank.busy, rank.tp_wait, 0.0
        start = -1.0
        for it in items:
            c = it.chain
            if it.first:
                lead = ag_times[c][it.kind]
                base, gather_wait = self._chain_start(rank, passes[c], t, ready[c], lead)
                tp_wait += gather_wait
                if lead > 0:
                    rank.tp_total += lead
                    sink.allreduce(it, ready[c], ready[c] + lead, "AG")
            else:
                base = t
            if it.waits_ar:
                s = max(base, chain_ar[c])
                in_a2a = s - max(base, chain_a2a[c])  # > 0: the wait ended in an all-to-all
                if in_a2a > 0:
                    a2a_wait += in_a2a
                    tp_wait -= in_a2a
                tp_wait += s - base
            else:
                s = base
            if start < 0:
                start = s
            e = s + unit_times[c][it.kind]
            busy += e - s
            sink.unit(it, s, e)
            if it.has_ar:
                kind = it.kind
                rs = rs_times[c][kind]
                ag = ag_times[c][kind] if it.unit != last_unit[c] else 0.0
                trail = ar_times[c][kind] + rs + ag
                a2a = a2a_times[c][kind]
                if trail > 0 or a2a > 0:
                    rank.tp_total += trail
                    rank.a2a_total += a2a
                    a0 = max(e, tp)
                    chain_a2a[c] = a0 + trail
                    tp = chain_ar[c] = a0 + trail + a2a
                    if trail > 0:
                        sink.allreduce(it, a0, a0 + trail,
                                       "RS+AG" if ag > 0 else "RS" if rs > 0 else "AR")
                    if a2a > 0:
                        sink.allreduce(it, chain_a2a[c], tp, "A2A")
                else:
                    chain_ar[c] = chain_a2a[c] = e
            chain_end[c] = max(e, chain_ar[c])
            t = e
        if len(passes) == 1:
            # plain TP code: the pass's last all-reduce is synchronous
            end = max(t, chain_ar[0])
            in_a2a = max(0.0, end - max(t, chain_a2a[0]))
            a2a_wait += in_a2a
            tp_wait += end - t - in_a2a
            t = end
        rank.lane, rank.tp, rank.busy, rank.tp_wait = t, tp, busy, tp_wait
        rank.a2a_wait += a2a_wait
        return start, chain_end

    def _chain_start(self, rank: RankLanes, p: Pass, t: float, arrival: float,
                     gather: float = 0.0) -> tuple[float, float]:
        """(when pass p's first unit may start on a lane free at `t`, the part of
        the wait spent on its leading all-gather): its input has arrived, the
        all-gather launched on arrival (`gather`, sequence parallelism) has
        ended and, for a backward of an offloaded forward, its copy back has
        ended (that wait counts as exposed offload time)."""
        base = max(t, arrival)
        if p.kind is _F:
            rank.first_f = min(rank.first_f, base)
        gathered = max(base, arrival + gather)
        if p.kind is _F:
            return gathered, gathered - base
        back = self.reload_ready.pop((p.stage, p.mb), None)
        if back is None:
            return gathered, gathered - base
        start = max(gathered, back)
        rank.off_wait += start - gathered
        return start, gathered - base

    def _output(self, rank: RankLanes, chain: int, p: Pass, fin: float) -> None:
        """Pass p (chain `chain` of the action) is final at `fin`: copy its
        activations out if the plan offloads them, mark its results done, and
        send its output on."""
        if p.kind is _F and (p.stage, p.mb) in self.offloaded:
            start = max(fin, rank.d2h)
            rank.d2h = start + self.table.copy_time[p.stage]
            self.copied_out[(p.stage, p.mb)] = rank.d2h
            rank.mem_events.append((rank.d2h, -self.table.chunk_act[p.stage]))
            self.sink.offload(chain, start, rank.d2h)
        rank.last_end = max(rank.last_end, fin)
        if p.kind is not _F:
            rank.grads_final[p.stage] = max(rank.grads_final.get(p.stage, 0.0), fin)
        for kind in p.provides():
            self.done[(p.stage, kind, p.mb)] = fin
        self.sink.sent(chain, fin)
