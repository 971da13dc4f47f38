"""`stp bench fidelity` (4 processes, pp = 2 x tp = 2): measures the
all-reduce of one unit's [b, s, h] partial sum and the one-way point-to-point
time, then runs each schedule on emulated stages (stp.models.emulated) and
times the executor's steps, for the simulator to predict with the same costs.

Runs under stp.runtime.launch.launch_local (`entry`); global rank 0 returns the
figures, stp.cli.bench simulates and prints them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from stp.bench.collectives import mean_over, measure_allreduce, measure_p2p
from stp.bench.world import in_world
from stp.models.emulated import EmulatedStage, UnitTimes
from stp.runtime.executor import Executor
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.runtime.trace import Recorder, gather_spans
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule

__all__ = ["FidelitySettings", "fidelity_worker", "entry"]


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


def fidelity_worker(s: FidelitySettings) -> dict[str, Any] | None:
    """See the module doc; returns the figures on global rank 0."""
    mesh = Mesh.from_world(ParallelDims(pp=2, tp=2), timeout=s.timeout)
    shape = (s.microbatch_size, s.seq_len, s.hidden)
    launch, done = measure_allreduce(mesh.tp_group, shape, 60, after=s.unit.f)
    iso = sum(measure_allreduce(mesh.tp_group, shape))
    out: dict[str, Any] = {
        "launch_s": mean_over(mesh, launch), "allreduce_s": mean_over(mesh, done),
        "allreduce_isolated_s": mean_over(mesh, iso), "p2p_s": measure_p2p(mesh, shape),
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


def entry(settings: FidelitySettings) -> dict[str, Any] | None:
    """A launched worker (module level: launch_local spawns it by name)."""
    return in_world(fidelity_worker, settings, settings.timeout)
