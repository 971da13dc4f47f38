"""`stp bench fidelity --sequence-parallel` (4 processes, pp = 2 x tp = 2): the
runtime with sequence parallelism, with and without in-layer TP overlap, on
emulated compute, against the simulator's prediction (stp.sim.predict).

First the collectives of one unit are timed as a run issues them, each after
an emulated unit (on a VM a collective after an idle wait is slower than back
to back): the all-gather of this rank's [b, s/t, h] rows (`gather_s`), the
reduce-scatter of a [b, s, h] partial sum (`scatter_s`), and the same cut into
K pieces as stp.models.tp.overlap issues them (all K gathers launched at once;
K scatters). `call_s`, what one more collective call costs over the whole one,
is (K pieces' time - the whole one's) / (K - 1), gathers and scatters averaged;
`launch_s` the compute stream's launch calls per chunk (a gather piece and a
scatter piece). Medians over `repeats`, the kinds interleaved. Then every
configuration (schedule, K; K = 0: no in-layer overlap, stp.bench.emulated_sp;
else stp.bench.emulated_chunked) runs one warm-up step and `rounds` timed
steps, the configurations alternating within a round (reversed every other
round, so drift in the machine's load falls on all alike); the median step of
each is its measured time. An F unit is also timed whole and as one of K
slices (`hold_s`, `slice_s`): the emulated compute's own cost of being cut.

Runs under stp.runtime.launch.launch_local (`entry`); global rank 0 returns the
figures, stp.cli.bench predicts and prints them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stp.bench.collectives import mean_over, measure_p2p
from stp.bench.emulated_chunked import EmulatedChunkedStage
from stp.bench.emulated_sp import EmulatedSPStage
from stp.bench.world import in_world
from stp.models.emulated import UnitTimes, hold
from stp.models.tp.overlap import ChunkedGather
from stp.models.tp.sequence import SequenceParallel
from stp.runtime.executor import Executor
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule

__all__ = ["InLayerSettings", "measure_sp_collectives", "inlayer_worker", "entry"]


@dataclass(frozen=True)
class InLayerSettings:
    configs: tuple[tuple[str, int], ...] = (("zb-v", 4), ("stp", 0), ("stp", 4))
    """(schedule, K) per configuration; K = 0: sequence parallelism without chunks."""
    microbatches: int = 8
    layers: int = 2
    """Layers per chunk (stage): a pass is 2 x layers units."""
    hidden: int = 256
    seq_len: int = 128
    microbatch_size: int = 4
    unit: UnitTimes = UnitTimes(10e-3, 10e-3, 8e-3)
    rounds: int = 5
    warmup: int = 1
    braid: bool = True
    repeats: int = 30
    timeout: float = 180.0


def _timed(launchers: dict[str, Any], after: float, repeats: int
           ) -> dict[str, tuple[float, float]]:
    """name -> (median launch-call seconds, median seconds from launch to completion)
    of each `launchers[name]()`, which starts collectives and returns a function
    waiting for them; each after an emulated unit of `after` seconds, the kinds
    interleaved within a repeat so that the machine's load falls on all alike
    (medians: a loaded machine's stalls are outliers, not the cost)."""
    calls: dict[str, list[float]] = {k: [] for k in launchers}
    totals: dict[str, list[float]] = {k: [] for k in launchers}
    for rep in range(repeats + 3):
        for name, launch in launchers.items():
            hold(after)
            start = time.perf_counter()
            wait = launch()
            mid = time.perf_counter()
            wait()
            if rep >= 3:
                calls[name].append(mid - start)
                totals[name].append(time.perf_counter() - start)
    return {k: (statistics.median(calls[k]), statistics.median(totals[k])) for k in launchers}


def measure_holds(unit: float, chunks: int, repeats: int) -> dict[str, float]:
    """Median seconds an emulated unit of `unit` seconds takes, whole and cut in
    `chunks` slices (one slice's): on a loaded machine each wait overshoots by a
    wake-up, so K slices take more than the whole."""
    whole: list[float] = []
    piece: list[float] = []
    for _ in range(repeats):
        for out, seconds in ((whole, unit), (piece, unit / chunks)):
            start = time.perf_counter()
            hold(seconds)
            out.append(time.perf_counter() - start)
    return {"hold_s": statistics.median(whole), "slice_s": statistics.median(piece)}


def measure_sp_collectives(seq: SequenceParallel, shape: tuple[int, int, int], chunks: int,
                           after: float, repeats: int) -> dict[str, float]:
    """One unit's all-gather and reduce-scatter, whole and in `chunks` pieces
    (module doc); seconds, this rank's medians."""
    b, s, h = shape
    rows, partial = torch.zeros((b, s // seq.size, h)), torch.zeros((b, s, h))

    def gather(k: int) -> Any:
        g = ChunkedGather(seq, rows, k)
        return lambda: [g.wait(i) for i in range(k)]

    def scatter(k: int) -> Any:
        p = s // k
        works = [seq.launch_scatter(partial.narrow(1, i * p, p))[1] for i in range(k)]
        return lambda: [w.wait() for w in works]

    kinds = {"ag": lambda: gather(1), "rs": lambda: scatter(1)}
    if chunks > 1:
        kinds.update(ag_k=lambda: gather(chunks), rs_k=lambda: scatter(chunks))
    t = _timed(kinds, after, repeats)
    out = {"gather_s": t["ag"][1], "scatter_s": t["rs"][1],
           "launch_whole_s": t["ag"][0] + t["rs"][0]}
    if chunks > 1:
        g_k, s_k = t["ag_k"][1], t["rs_k"][1]
        out.update(gather_chunked_s=g_k, scatter_chunked_s=s_k,
                   call_s=max(0.0, (g_k - out["gather_s"] + s_k - out["scatter_s"]) / 2
                              / (chunks - 1)),
                   launch_chunk_s=(t["ag_k"][0] + t["rs_k"][0]) / chunks)
    return out


def _executor(name: str, chunks: int, s: InLayerSettings, mesh: Mesh) -> tuple[Executor, Any]:
    sch = make_schedule(name, 2, s.microbatches)
    kind: Any = EmulatedChunkedStage if chunks else EmulatedSPStage
    extra = {"chunks": chunks} if chunks else {}
    stages = {st: kind(st, sch.num_stages, layers=s.layers, hidden=s.hidden, times=s.unit,
                       tp_group=mesh.tp_group, tp_size=2, tp_rank=mesh.coord.tp, **extra)
              for st in sch.stages_of(mesh.coord.pp)}
    p2p = P2P(mesh.pp_group, mesh.ranks["pp"], sch.num_stages, timeout=s.timeout,
              where=mesh.describe())
    shape = (s.microbatch_size, s.seq_len // 2, s.hidden)  # SP: this rank's rows
    ex = Executor(lower(sch), mesh.coord.pp, stages, p2p, boundary_shape=shape,
                  dtype=torch.float32, where=mesh.describe(), braid=s.braid)
    return ex, stages


def _step(ex: Executor, ids: torch.Tensor, m: int, mesh: Mesh) -> float:
    """One step's wall time, first rank's start to last rank's end."""
    dist.barrier()
    start = time.perf_counter()
    ex.run([ids] * m, [ids] * m)
    ends: list[Any] = [None] * mesh.dims.world_size
    dist.all_gather_object(ends, (start, time.perf_counter()))
    return max(e for _, e in ends) - min(b for b, _ in ends)


def inlayer_worker(s: InLayerSettings) -> dict[str, Any] | None:
    """See the module doc; returns the figures on global rank 0."""
    mesh = Mesh.from_world(ParallelDims(pp=2, tp=2), timeout=s.timeout)
    shape = (s.microbatch_size, s.seq_len, s.hidden)
    seq = SequenceParallel(mesh.tp_group, 2, mesh.coord.tp)
    chunk_sizes = sorted({k for _, k in s.configs if k > 1})
    measured: dict[str, Any] = {"chunked": {}}
    for k in chunk_sizes or [1]:
        figures = measure_sp_collectives(seq, shape, k, s.unit.f, s.repeats)
        figures = {key: mean_over(mesh, v) for key, v in figures.items()}
        measured.update({key: figures[key] for key in ("gather_s", "scatter_s",
                                                       "launch_whole_s")})
        if k > 1:
            measured["chunked"][str(k)] = {key: figures[key] for key in (
                "gather_chunked_s", "scatter_chunked_s", "call_s", "launch_chunk_s")}
            holds = measure_holds(s.unit.f, k, s.repeats)
            measured["chunked"][str(k)].update(
                {key: mean_over(mesh, v) for key, v in holds.items()})
    measured["p2p_s"] = measure_p2p(mesh, (s.microbatch_size, s.seq_len // 2, s.hidden))
    ids = torch.randint(0, 256, (s.microbatch_size, s.seq_len),
                        generator=torch.Generator().manual_seed(0))
    runs = [_executor(name, k, s, mesh) for name, k in s.configs]
    steps: list[list[float]] = [[] for _ in runs]
    for r in range(s.warmup + s.rounds):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            t = _step(runs[i][0], ids, s.microbatches, mesh)
            if r >= s.warmup:
                steps[i].append(t)
    measured["rows"] = [
        {"schedule": name, "chunks": k, "measured": statistics.median(times), "steps": times,
         "pieces_per_step": _pieces(runs[i][1]) // (s.warmup + s.rounds) if k else 0}
        for i, ((name, k), times) in enumerate(zip(s.configs, steps, strict=True))]
    return measured if mesh.rank == 0 else None


def _pieces(stages: dict[int, Any]) -> int:
    return sum(st.pieces_launched for st in stages.values()
               if isinstance(st, EmulatedChunkedStage))


def entry(settings: InLayerSettings) -> dict[str, Any] | None:
    """A launched worker (module level: launch_local spawns it by name)."""
    return in_world(inlayer_worker, settings, settings.timeout)
