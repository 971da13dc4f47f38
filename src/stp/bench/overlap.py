"""The measured side of `stp bench` (stp.cli.bench prints and simulates).

* `overlap_worker` (2 processes, tp = 2): one stage of `layers` layers; the
  same work, F of microbatch 1 and B of microbatch 0, run as two lone passes
  and as one braided block (STP paper arXiv 2510.27257, Fig. 3), in emulated and in real
  compute. Exposed all-reduce time is compute-stream time spent launching
  and waiting for all-reduces (stp.runtime.braid.RunnerStats), the held
  tails of the block included.
* `fidelity_worker` (4 processes, pp = 2 x tp = 2): measures the all-reduce
  of one unit's [b, s, h] partial sum and the one-way point-to-point time,
  then runs each schedule on emulated stages (stp.models.emulated) and times
  the executor's steps, for the simulator to predict with the same costs.

Both run under stp.runtime.launch.launch_local; global rank 0 returns the
figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stp.models import ModelConfig, build_stage
from stp.models.emulated import EmulatedStage, UnitTimes, hold
from stp.runtime.braid import UnitRunner
from stp.runtime.executor import Executor
from stp.runtime.launch import init_distributed
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.runtime.trace import Recorder, gather_spans
from stp.schedule.ir import Block, Kind, Pass
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule

__all__ = ["OverlapSettings", "FidelitySettings", "measure_allreduce", "measure_p2p",
           "overlap_worker", "fidelity_worker", "entry"]


@dataclass(frozen=True)
class OverlapSettings:
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    seq_len: int = 128
    microbatch_size: int = 4
    unit: UnitTimes = UnitTimes(6e-3, 6e-3, 6e-3)
    """Emulated seconds per F / B / W unit."""
    repeats: int = 10
    modes: tuple[str, ...] = ("emulated", "real")
    timeout: float = 120.0


@dataclass(frozen=True)
class FidelitySettings:
    schedules: tuple[str, ...] = ("1f1b-interleaved", "zb-v", "stp")
    microbatches: int = 8
    layers: int = 2
    """Layers per chunk (stage): a pass is 2 x layers units."""
    hidden: int = 256
    seq_len: int = 128
    microbatch_size: int = 4
    unit: UnitTimes = UnitTimes(6e-3, 6e-3, 4e-3)
    steps: int = 3
    warmup: int = 1
    braid: bool = True
    timeout: float = 120.0
    trace: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def measure_allreduce(
    group: dist.ProcessGroup, shape: tuple[int, ...], repeats: int = 30, after: float = 0.0
) -> tuple[float, float]:
    """(launch, completion) seconds of a sum all-reduce of `shape` floats: the mean
    time of the async launch call, and the mean time from its return to the end of
    the wait. `after` > 0: each one follows an emulated unit of that many seconds,
    as in a run (on a VM, an all-reduce after an idle wait is several times slower
    than back to back); else each follows a barrier."""
    t = torch.zeros(shape)
    launch, done = [], []
    for k in range(repeats + 3):
        if after > 0:
            hold(after)
        else:
            dist.barrier(group=group)
        start = time.perf_counter()
        work = dist.all_reduce(t, group=group, async_op=True)
        mid = time.perf_counter()
        work.wait()
        if k >= 3:
            launch.append(mid - start)
            done.append(time.perf_counter() - mid)
    return statistics.mean(launch), statistics.mean(done)


def measure_p2p(mesh: Mesh, shape: tuple[int, ...], repeats: int = 30) -> float:
    """Median one-way seconds of a `shape` send between pipeline ranks 0 and 1
    (half a ping-pong), measured by pipeline rank 0 and shared with all."""
    t = torch.zeros(shape)
    pp, peers, group = mesh.coord.pp, mesh.ranks["pp"], mesh.pp_group
    times = []
    for k in range(repeats + 3):
        dist.barrier(group=group)
        start = time.perf_counter()
        if pp == 0:
            dist.send(t, peers[1], group=group)
            dist.recv(t, peers[1], group=group)
        elif pp == 1:
            dist.recv(t, peers[0], group=group)
            dist.send(t, peers[0], group=group)
        if k >= 3:
            times.append((time.perf_counter() - start) / 2)
    out = [statistics.median(times)]
    dist.broadcast_object_list(out, src=peers[0], group=group)
    return float(out[0])


def _mean_over(mesh: Mesh, value: float) -> float:
    """Mean of `value` over every rank of the world."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / mesh.dims.world_size


def _overlap_stage(mode: str, s: OverlapSettings, mesh: Mesh) -> Any:
    if mode == "emulated":
        return EmulatedStage(0, 1, layers=s.layers, hidden=s.hidden, times=s.unit,
                             tp_group=mesh.tp_group, tp_size=2)
    cfg = ModelConfig(hidden=s.hidden, num_layers=s.layers, num_heads=s.heads,
                      num_kv_heads=s.heads, max_seq_len=s.seq_len)
    return build_stage(cfg, 0, 1, tp_group=mesh.tp_group, tp_size=2, tp_rank=mesh.coord.tp)


def overlap_worker(s: OverlapSettings) -> dict[str, Any] | None:
    """See the module doc; returns the figures on global rank 0."""
    mesh = Mesh.from_world(ParallelDims(pp=1, tp=2), timeout=s.timeout)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (s.microbatch_size, s.seq_len + 1), generator=gen)
    tokens, targets = ids[:, :-1], ids[:, 1:]
    shape = (s.microbatch_size, s.seq_len, s.hidden)
    out: dict[str, Any] = {"allreduce_s": sum(measure_allreduce(mesh.tp_group, shape))}
    for mode in s.modes:
        stage = _overlap_stage(mode, s, mesh)
        runner = UnitRunner({0: stage}, take=lambda p: tokens, give=lambda p, y: None,
                            targets=lambda mb: targets)
        f0, f1, b0, b1 = Pass(0, Kind.F, 0), Pass(0, Kind.F, 1), Pass(0, Kind.B, 0), \
            Pass(0, Kind.B, 1)
        work = {"sequential": [f1, b0], "braided": [Block((f1, b0))]}
        res: dict[str, dict[str, list[float]]] = {
            k: {"wall": [], "exposed": [], "launch": []} for k in work}
        for rep in range(s.repeats + 1):
            for name, actions in work.items():
                runner.run(f0)
                dist.barrier(group=mesh.tp_group)
                before, start = runner.stats.exposed_s, time.perf_counter()
                launched, launch_before = runner.stats.launched, runner.stats.launch_s
                for a in actions:
                    runner.run(a)
                runner.release()  # the block's held all-reduces count too
                wall = time.perf_counter() - start
                exposed = runner.stats.exposed_s - before
                count = runner.stats.launched - launched
                launch = runner.stats.launch_s - launch_before
                for a in (b1, Pass(0, Kind.W, 0), Pass(0, Kind.W, 1)):
                    runner.run(a)
                if rep > 0:  # the first round warms up
                    res[name]["wall"].append(wall)
                    res[name]["exposed"].append(exposed)
                    res[name]["launch"].append(launch)
        med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
        seq, br = med["sequential"]["exposed"], med["braided"]["exposed"]
        waits = [med[k]["exposed"] - med[k]["launch"] for k in ("sequential", "braided")]
        out[mode] = {
            "hidden_fraction": 1.0 - br / seq if seq > 0 else 0.0,
            "wait_hidden_fraction": 1.0 - waits[1] / waits[0] if waits[0] > 0 else 0.0,
            "exposed_sequential_s": seq, "exposed_braided_s": br,
            "wall_sequential_s": med["sequential"]["wall"],
            "wall_braided_s": med["braided"]["wall"],
            "launch_sequential_s": med["sequential"]["launch"],
            "launch_braided_s": med["braided"]["launch"],
            "allreduces": count,
        }
    return out if mesh.rank == 0 else None


def fidelity_worker(s: FidelitySettings) -> dict[str, Any] | None:
    """See the module doc; returns the figures on global rank 0."""
    mesh = Mesh.from_world(ParallelDims(pp=2, tp=2), timeout=s.timeout)
    shape = (s.microbatch_size, s.seq_len, s.hidden)
    launch, done = measure_allreduce(mesh.tp_group, shape, 60, after=s.unit.f)
    iso = sum(measure_allreduce(mesh.tp_group, shape))
    out: dict[str, Any] = {
        "launch_s": _mean_over(mesh, launch), "allreduce_s": _mean_over(mesh, done),
        "allreduce_isolated_s": _mean_over(mesh, iso), "p2p_s": measure_p2p(mesh, shape),
        "rows": [],
    }
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (s.microbatch_size, s.seq_len), generator=gen)
    for name in s.schedules:
        sch = make_schedule(name, 2, s.microbatches)
        pp = mesh.coord.pp
        stages = {st: EmulatedStage(st, sch.num_stages, layers=s.layers, hidden=s.hidden,
                                    times=s.unit, tp_group=mesh.tp_group, tp_size=2)
                  for st in sch.stages_of(pp)}
        p2p = P2P(mesh.pp_group, mesh.ranks["pp"], sch.num_stages, timeout=s.timeout,
                  where=mesh.describe())
        rec = Recorder(mesh.rank, [sch.chunk_of(x) for x in range(sch.num_stages)]) \
            if s.trace else None
        ex = Executor(lower(sch), pp, stages, p2p, boundary_shape=shape, dtype=torch.float32,
                      where=mesh.describe(), braid=s.braid, recorder=rec)
        m = sch.num_microbatches
        steps = []
        for k in range(s.warmup + s.steps):
            dist.barrier()
            start = time.perf_counter()
            ex.run([ids] * m, [ids] * m)
            ends: list[Any] = [None] * mesh.dims.world_size
            dist.all_gather_object(ends, (start, time.perf_counter()))
            if k >= s.warmup:
                steps.append(max(e for _, e in ends) - min(b for b, _ in ends))
        st = ex.runner.stats if ex.runner is not None else None
        row: dict[str, Any] = {"schedule": name, "measured": statistics.median(steps),
                               "steps": steps, "chunks": sch.chunks,
                               "launch_s": st.launch_s / max(1, st.launched) if st else 0.0,
                               "wait_s_per_step": st.wait_s / (s.warmup + s.steps) if st else 0.0}
        if rec is not None:
            row["spans"] = gather_spans(rec)
        out["rows"].append(row)
    return out if mesh.rank == 0 else None


def entry(kind: str, settings: Any) -> dict[str, Any] | None:
    """A launched worker (module level, spawned by name): `kind` overlap or fidelity."""
    init_distributed(timeout=settings.timeout)
    try:
        return (overlap_worker if kind == "overlap" else fidelity_worker)(settings)
    finally:
        dist.destroy_process_group()
