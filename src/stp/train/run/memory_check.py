"""`stp train` refuses a run that cannot fit before any worker allocates.

The estimate is the cost model's (`stp.costmodel.memory.estimate`: weights,
gradients, masters, optimizer state, the simulator's peak activations for the
run's schedule, partition, offload, recomputation and sequence parallelism,
buffers) for the run's own model, mesh, batch and dtype, with the activations
stp's own decoder units keep (`stp.costmodel.decoder.kept`): `run_estimate`, the one
function `stp train` and `stp memory` (given a train command line) both call.

- `--memory-budget SIZE`: the peak rank's total must fit SIZE (one device).
- without it, every rank this machine runs together (the whole world for
  `stp train`'s own launcher, LOCAL_WORLD_SIZE under torchrun) must fit the
  host's available memory (MemAvailable): a run of `--seq-len 1048576` is
  refused in one line instead of allocating until the kernel kills it.

Emulated stages are not checked. Each family is priced by its row of the cost
model's family table (stp.costmodel.families: its spec from the run's config,
its estimate): a mixture of experts with its routed copies and router
(`stp.costmodel.moe`) at the job's `--ep`; the multimodal model with what its
encoder's and decoder's units keep (`stp.costmodel.mllm.memory`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from stp.costmodel import HARDWARE
from stp.costmodel.budget import parse_size
from stp.costmodel.configs import spec_from_config
from stp.costmodel.families import pricing_of_config
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.memory import Features, Layout, MemoryEstimate, estimate, format_bytes

if TYPE_CHECKING:  # resolve imports the checks' callers; the types only
    from stp.train.run.config import TrainJob
    from stp.train.run.resolve import Run

__all__ = ["available_host_bytes", "check_memory", "no_estimate_reason", "run_estimate",
           "run_features"]


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def no_estimate_reason(run: Run) -> str | None:
    """Why `run` has no byte estimate (None: it has one)."""
    job = run.job
    if job.emulate is not None:
        return "--emulate-compute stages wait instead of computing: they hold no model"
    if pricing_of_config(run.config) is None:
        return (f"--arch {job.arch}: the byte model prices the families of "
                "stp.costmodel.families only (stp.costmodel.memory)")
    return None


def run_features(job: TrainJob, *, recompute: str | None = None,
                 shard_optimizer: bool | None = None) -> Features:
    """What of `job` (a TrainJob) changes its memory; `recompute` and
    `shard_optimizer` given here stand in for the job's (`stp memory`'s own flags)."""
    if recompute is None:
        recompute = job.recompute
    if shard_optimizer is None:
        shard_optimizer = bool(job.shard_optimizer)
    return Features(dtype=job.dtype, offload=job.offload, recompute=recompute,
                    sequence_parallel=job.sequence_parallel and job.tp > 1,
                    shard_optimizer=shard_optimizer, runtime="stp",
                    overlap_grad_sync=bool(job.overlap_grad_sync))


def run_estimate(run: Run, hardware: HardwareSpec | None = None,
                 features: Features | None = None,
                 mean_doc_len: int | None = None) -> MemoryEstimate | None:
    """The cost model's bytes per rank of `run` (stp.train.run.resolve.Run): its model,
    mesh, batch, schedule (a file's too), partition and `run_features`; None where
    there is no estimate (`no_estimate_reason`). The one estimate `stp train`
    checks before launching and `stp memory` prints for a train command line.
    `hardware` (default a100-80g) only sets the offload link and the step time;
    `mean_doc_len` (document masking) only the step time too."""
    if no_estimate_reason(run) is not None:
        return None
    job = run.job
    spec = spec_from_config(run.config, seq_len=job.model.seq_len,
                            microbatch_size=job.microbatch_size, tp=job.tp,
                            flash_attention=False)
    if mean_doc_len is not None:
        spec = replace(spec, mean_doc_len=mean_doc_len)
    layout = Layout(pp=job.pp, tp=job.tp, dp=job.dp,
                    microbatches=run.schedule.num_microbatches,
                    microbatch_size=job.microbatch_size, seq_len=job.model.seq_len,
                    schedule=run.schedule.name, partition=run.partition,
                    ep=job.ep)
    return estimate(spec, hardware or HARDWARE["a100-80g"], layout,
                    features or run_features(job), schedule=run.schedule)


def _largest(est: MemoryEstimate) -> str:
    peak = est.peak
    name = peak.largest
    return f"{name.replace('_', ' ')} {format_bytes(getattr(peak, name))}"


def check_memory(run: Run, local_ranks: int | None = None) -> None:
    """ValueError (one line) when the run's estimate exceeds `--memory-budget`, or with
    no budget when the ranks this machine runs exceed its available memory."""
    job = run.job
    budget = None
    if job.memory_budget is not None:
        try:
            budget = parse_size(job.memory_budget)
        except ValueError as e:
            raise ValueError(f"--memory-budget {e}") from None
    est = run_estimate(run)
    if est is None:
        return
    peak = est.peak
    if budget is not None:
        if peak.total > budget:
            raise ValueError(f"--memory-budget {job.memory_budget}: pipeline rank {peak.rank} "
                             f"needs an estimated {format_bytes(peak.total)}, most of it "
                             f"{_largest(est)}; give a larger budget, more --pp/--tp, a "
                             "shorter --seq-len or a smaller --microbatch-size")
        return
    free = available_host_bytes()
    if free is None:
        return
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", job.world_size))
    if ranks == job.world_size:  # every pipeline rank here, with its tp x dp peers
        total = sum(r.total for r in est.ranks) * job.tp * job.dp
    else:  # some ranks of a larger world: the heaviest, as a bound
        total = peak.total * ranks
    if total > free:
        raise ValueError(f"this run needs an estimated {format_bytes(total)} on this machine "
                         f"({ranks} ranks; pipeline rank {peak.rank}: "
                         f"{format_bytes(peak.total)}, most of it {_largest(est)}) but "
                         f"{format_bytes(free)} is available; give a shorter --seq-len, a "
                         "smaller --microbatch-size or fewer -m, or --memory-budget SIZE to "
                         "judge it against a device instead")
