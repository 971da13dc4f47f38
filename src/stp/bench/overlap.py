"""`stp bench overlap` (2 processes, tp = 2): one stage of `layers` layers; the
same work, F of microbatch 1 and B of microbatch 0, run as two lone passes and
as one braided block (STP paper arXiv 2510.27257, Fig. 3), in emulated and in
real compute. Exposed all-reduce time is compute-stream time spent launching
and waiting for all-reduces (stp.runtime.braid.RunnerStats), the held tails of
the block included. With `sequence_parallel` every mode is measured twice, with
the all-reduces and with sequence parallelism's reduce-scatters and all-gathers
(emulated: stp.bench.emulated_sp; real: the model's SP units), both with F
braided with a full backward (B and W of microbatch 0), the block where the
all-gathers can hide too; the SP figures are keyed `<mode>_sp`. With
`all_to_all` the emulated stage is measured once more with an expert
all-to-all ending each unit in place of the all-reduce (stp.bench.emulated_a2a,
`a2a_top_k` rows per token, the same block), keyed `emulated_a2a`: the hidden
fraction of the all-to-all beside the all-reduce's, in the same run; and once
more with the all-reduces launched from the communication thread the
all-to-alls use (stp.models.moe.comm_thread), keyed `emulated_ar_thread`.

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
from stp.bench.emulated_a2a import EmulatedA2AStage, ThreadLaunchedARStage
from stp.bench.emulated_sp import EmulatedSPStage
from stp.bench.world import in_world
from stp.models import ModelConfig, StagePlacement, build_stage
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
    """Also measure sequence parallelism (stp.models.tp.sequence): its exposed time counts
    the reduce-scatters' launches and waits and the all-gathers."""
    all_to_all: bool = False
    """Also measure the emulated stage with an expert all-to-all ending each unit."""
    a2a_top_k: int = 2
    """Experts per token in that all-to-all (stp.bench.emulated_a2a): 2 sends the bytes
    of the all-reduce, 1 half of them."""


def _overlap_stage(mode: str, sp: bool, s: OverlapSettings, mesh: Mesh) -> Any:
    if mode == "emulated":
        kind = EmulatedSPStage if sp else EmulatedStage
        extra = {"tp_rank": mesh.coord.tp} if sp else {}
        return kind(0, 1, layers=s.model.num_layers, hidden=s.model.hidden, times=s.unit,
                    tp_group=mesh.tp_group, tp_size=2, **extra)
    return build_stage(s.model, StagePlacement(0, 1, tp_group=mesh.tp_group, tp_size=2,
                                               tp_rank=mesh.coord.tp, sequence_parallel=sp))


def _measure(stage: Any, s: OverlapSettings, mesh: Mesh, tokens: torch.Tensor,
             targets: torch.Tensor) -> dict[str, Any]:
    """Exposed collective time of F(1) then B(0), and of the two braided (module doc)."""
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
    count = 0
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
    return {
        "hidden_fraction": _fraction(br, seq),
        "wait_hidden_fraction": _fraction(max(0.0, waits[1]), max(0.0, waits[0])),
        "exposed_sequential_s": seq, "exposed_braided_s": br,
        "wall_sequential_s": med["sequential"]["wall"],
        "wall_braided_s": med["braided"]["wall"],
        "launch_sequential_s": med["sequential"]["launch"],
        "launch_braided_s": med["braided"]["launch"],
        "allreduces": count,
        "advanced": runner.stats.advanced,
    }


def _fraction(braided: float, sequential: float) -> float:
    """1 - braided / sequential, in [0, 1]: a braided run slower than the sequential one
    (a loaded machine) hid nothing."""
    return min(1.0, max(0.0, 1.0 - braided / sequential)) if sequential > 0 else 0.0


def overlap_worker(s: OverlapSettings) -> dict[str, Any] | None:
    """See the module doc; returns the figures on global rank 0."""
    mesh = Mesh.from_world(ParallelDims(pp=1, tp=2), timeout=s.timeout)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (s.microbatch_size, s.seq_len + 1), generator=gen)
    tokens, targets = ids[:, :-1], ids[:, 1:]
    shape = (s.microbatch_size, s.seq_len, s.model.hidden)
    out: dict[str, Any] = {"allreduce_s": sum(measure_allreduce(mesh.tp_group, shape))}
    for mode in s.modes:
        for sp in (False, True) if s.sequence_parallel else (False,):
            stage = _overlap_stage(mode, sp, s, mesh)
            out[mode + ("_sp" if sp else "")] = _measure(stage, s, mesh, tokens, targets)
    if s.all_to_all:
        stage = EmulatedA2AStage(0, 1, layers=s.model.num_layers, hidden=s.model.hidden,
                                 times=s.unit, tp_group=mesh.tp_group, tp_size=2,
                                 top_k=s.a2a_top_k)
        out["emulated_a2a"] = _measure(stage, s, mesh, tokens, targets)
        stage = ThreadLaunchedARStage(0, 1, layers=s.model.num_layers, hidden=s.model.hidden,
                                      times=s.unit, tp_group=mesh.tp_group, tp_size=2)
        out["emulated_ar_thread"] = _measure(stage, s, mesh, tokens, targets)
    return out if mesh.rank == 0 else None


def entry(settings: OverlapSettings) -> dict[str, Any] | None:
    """A launched worker (module level: launch_local spawns it by name)."""
    return in_world(overlap_worker, settings, settings.timeout)
