"""`stp bench overlap` (2 processes, tp = 2): one stage of `layers` layers; the
same work, F of microbatch 1 and B of microbatch 0, run as two lone passes and
as one braided block (STP paper arXiv 2510.27257, Fig. 3), in emulated and in
real compute. Exposed all-reduce time is compute-stream time spent launching
and waiting for all-reduces (stp.runtime.braid.RunnerStats), the held tails of
the block included. With `sequence_parallel` (real compute only) the same for
the reduce-scatters and all-gathers, with F braided with a full backward (B
and W of microbatch 0), the block where the all-gathers can hide too.

Runs under stp.runtime.launch.launch_local (`entry`); global rank 0 returns the
figures, stp.cli.bench prints them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stp.bench.collectives import measure_allreduce
from stp.bench.world import in_world
from stp.models import ModelConfig, build_stage
from stp.models.emulated import EmulatedStage, UnitTimes
from stp.runtime.braid import UnitRunner
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule.ir import Block, Kind, Pass

__all__ = ["OverlapSettings", "overlap_worker", "entry"]


@dataclass(frozen=True)
class OverlapSettings:
    model: ModelConfig = ModelConfig(hidden=256, num_layers=8, num_heads=4, num_kv_heads=4,
                                     max_seq_len=128)
    """The stage's model ("real" mode; "emulated" takes its layers and width)."""
    seq_len: int = 128
    microbatch_size: int = 4
    unit: UnitTimes = UnitTimes(6e-3, 6e-3, 6e-3)
    """Emulated seconds per F / B / W unit."""
    repeats: int = 10
    modes: tuple[str, ...] = ("emulated", "real")
    timeout: float = 120.0
    sequence_parallel: bool = False
    """Real compute with sequence parallelism (stp.models.tp.sequence): the exposed time
    then counts the reduce-scatters' launches and waits and the all-gathers."""


def _overlap_stage(mode: str, s: OverlapSettings, mesh: Mesh) -> Any:
    if mode == "emulated":
        return EmulatedStage(0, 1, layers=s.model.num_layers, hidden=s.model.hidden,
                             times=s.unit,
                             tp_group=mesh.tp_group, tp_size=2)
    return build_stage(s.model, 0, 1, tp_group=mesh.tp_group, tp_size=2, tp_rank=mesh.coord.tp,
                       sequence_parallel=s.sequence_parallel)


def overlap_worker(s: OverlapSettings) -> dict[str, Any] | None:
    """See the module doc; returns the figures on global rank 0."""
    mesh = Mesh.from_world(ParallelDims(pp=1, tp=2), timeout=s.timeout)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (s.microbatch_size, s.seq_len + 1), generator=gen)
    tokens, targets = ids[:, :-1], ids[:, 1:]
    shape = (s.microbatch_size, s.seq_len, s.model.hidden)
    out: dict[str, Any] = {"allreduce_s": sum(measure_allreduce(mesh.tp_group, shape))}
    for mode in s.modes:
        stage = _overlap_stage(mode, s, mesh)
        runner = UnitRunner({0: stage}, take=lambda p: tokens, give=lambda p, y: None,
                            targets=lambda mb: targets)
        f0, f1, b0, b1 = Pass(0, Kind.F, 0), Pass(0, Kind.F, 1), Pass(0, Kind.B, 0), \
            Pass(0, Kind.B, 1)
        # SP: B of microbatch 0 as a full backward (B then W), the STP schedule's
        # steady-state block, where the braid has room to hide the all-gathers too
        second = Pass(0, Kind.BW, 0) if s.sequence_parallel else b0
        after = (b1, Pass(0, Kind.W, 1)) if s.sequence_parallel else (
            b1, Pass(0, Kind.W, 0), Pass(0, Kind.W, 1))
        work = {"sequential": [f1, second], "braided": [Block((f1, second))]}
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
                for a in after:
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


def entry(settings: OverlapSettings) -> dict[str, Any] | None:
    """A launched worker (module level: launch_local spawns it by name)."""
    return in_world(overlap_worker, settings, settings.timeout)
