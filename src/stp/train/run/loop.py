"""The training loop of one `stp train` run on an initialised world.

`run(resolved, on_step)` takes a job resolved once (stp.train.run.resolve.Run),
builds the mesh, the data and the Trainer (loaded from `job.resume` when
given), takes optimizer steps up to `job.steps` (a resumed
run continues at the checkpoint's step: batches are a function of the step,
so its data continue too), evaluates every `job.eval_every` steps, writes a
sharded checkpoint every `job.save_every` steps and after the last one,
calls `on_step` on global rank 0 after each step, writes the trace, the
Hugging Face checkpoint (`job.save_hf`) and the single safetensors file
(`job.save_full`) when asked, and returns a `RunSummary` on rank 0 (None on
the others). Nothing gathers the whole model on one rank: the sharded
checkpoint is the run's output, and the two exports are written stage by
stage (stp.models.hf.save, stp.train.checkpoint.save_full).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stp.costmodel.peaks import Peak
from stp.models.compile import compile_stats
from stp.runtime.launch import in_torchrun
from stp.runtime.mesh import Mesh, ParallelDims
from stp.train.checkpoint.resume import write_settings
from stp.train.checkpoint.storage import StorageFault, cause_of
from stp.train.data.load import data_fingerprint, data_options
from stp.train.data.prefetch import Prefetched
from stp.train.data.record import write_data_record
from stp.train.run.config import TrainJob
from stp.train.run.memory_measure import CATEGORIES, measure
from stp.train.run.metrics import MetricsLog
from stp.train.run.mfu import device_peak, step_flops, unknown_peak_line
from stp.train.run.mfu import mfu as mfu_of
from stp.train.run.outlock import lock_error
from stp.train.run.pretrained import copy_tokenizer
from stp.train.run.resolve import Run
from stp.train.run.startup import Startup
from stp.train.step.finite import SkipCounter
from stp.train.step.lr import LRSchedule, adamw
from stp.train.step.trainer import Trainer, TrainerOptions

__all__ = ["StepReport", "RunSummary", "run"]


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    resident_activation_bytes: list[int] | None = None
    """Peak resident activation bytes of the step, per global rank."""
    grad_norm: float | None = None
    """Global gradient norm before clipping."""
    lr: float | None = None
    """Learning rate the step's update used."""
    skipped: bool = False
    """The gradients held inf/NaN: no rank updated (stp.train.step.precision)."""
    eval_loss: float | None = None
    """Mean loss on the held-out data, on the steps that evaluate."""
    checkpoint: str | None = None
    """The sharded checkpoint this step wrote (None: none written)."""
    figures: dict[str, float] | None = None
    """Objective terms beside the loss (an MoE's `aux_loss`, `expert_load`)."""
    compile_s: float | None = None
    """With --compile: seconds of this step spent compiling, on the rank that spent
    the most (inside step_time_s; 0 once every shape is compiled)."""
    mfu: float | None = None
    """Model FLOPs of the step over step_time_s and the mesh's dense peak
    (stp.train.run.mfu); None when the peak is unknown (the CPU)."""
    startup: dict[str, float] | None = None
    """On the process's first step: time to first step and its parts, in seconds, on
    global rank 0 (stp.train.run.startup: `total`, imports, checks, workers, data, build,
    load, compile, step, other)."""


@dataclass(frozen=True)
class RunSummary:
    """What rank 0 reports at the end of a run."""

    job: TrainJob
    microbatches: int
    backend: str
    device: str
    parameters: int
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    tokens_per_step: int
    resident_activation_bytes: list[int] | None
    checkpoint: str | None
    """The last sharded checkpoint written (what --resume loads; None: none written)."""
    memory: list[dict[str, int]] | None = None
    """Each global rank's measured bytes by category and its pipeline rank `pp`
    (stp.train.run.memory_measure; `dp_copies`: what the DP reductions' gradient copies
    in flight added to the peak of resident activations, `StepMemory.peak_with_held`)."""
    compile_s: float | None = None
    """With --compile: the steps' compile seconds (StepReport.compile_s), summed."""
    step_flops: float | None = None
    """Model FLOPs of one step over the whole mesh (stp.train.run.mfu.step_flops)."""
    peak: Peak | None = None
    """One device's dense peak for the run's dtype; None: unknown (the CPU)."""

    @property
    def mfu(self) -> float | None:
        """MFU of the mean step time (step_time_s: the first step left out)."""
        t = self.step_time_s
        return None if t is None else mfu_of(self.step_flops, t, self.job.world_size, self.peak)

    @property
    def mfu_line(self) -> str:
        """The log's MFU line: the figure and what it divides, or why there is none."""
        value = self.mfu
        if value is None or self.peak is None or self.step_flops is None:
            return unknown_peak_line(self.device, self.job.dtype, self.job.emulate is not None)
        return (f"MFU {value:.1%}: {self.step_flops:.3g} model FLOPs a step (as stp plan "
                f"counts them: causal attention full, recomputation not counted) over "
                f"{self.job.world_size} x {self.peak.flops / 1e12:g} TFLOP/s dense "
                f"({self.peak.source})")
    startup: dict[str, float] | None = None
    """Time to first step and its parts (StepReport.startup)."""

    @property
    def first_loss(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def step_time_s(self) -> float | None:
        """Mean step time without the first step (warm-up), when there are more."""
        steady = self.step_times_s[1:] or self.step_times_s
        return sum(steady) / len(steady) if steady else None

    @property
    def tokens_per_s(self) -> float | None:
        t = self.step_time_s
        return None if t is None else self.tokens_per_step / t


EVAL_BATCHES = 4
"""Fixed held-out global batches averaged by each evaluation (the same ones every time,
so evaluations compare)."""


def _eval_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The EVAL_BATCHES held-out global batches (the family's: --eval-data's text, or
    with --arch mllm held-out images)."""
    if not run.job.eval_every or run.job.emulate is not None:
        return []
    data = run.family.eval_batches(run)
    return [] if data is None else [data.batch(i) for i in range(EVAL_BATCHES)]


def _after_step(job: TrainJob, trainer: Trainer, step: int,
                evals: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float | None, str | None]:
    """Evaluate and save when the step calls for it: (eval loss, checkpoint path)."""
    done = step + 1
    eval_loss = None
    if evals and done % job.eval_every == 0:
        eval_loss = sum(trainer.evaluate(b) for b in evals) / len(evals)
    saved = None
    if done == job.steps or (job.save_every and done % job.save_every == 0):
        saved = trainer.save(str(job.out_dir()), keep=job.keep)
    return eval_loss, saved


def _shared_out(run: Run) -> Run:
    """`run` with global rank 0's --out on every rank (the default names the time)."""
    box = [str(run.job.out_dir()) if dist.get_rank() == 0 else None]  # the default creates it
    dist.broadcast_object_list(box, src=0)
    if in_torchrun():  # under torchrun rank 0 locks --out (stp's launcher did already)
        error = [lock_error(str(box[0])) if dist.get_rank() == 0 else None]  # rank 0's --out
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise ValueError(error[0])
    return dataclasses.replace(run, job=dataclasses.replace(run.job, out=box[0]))


def _document_eos(run: Run) -> int | None:
    """--document-mask's end-of-sequence id: --eos-id, else the tokenizer's."""
    job = run.job
    if not job.document_mask:
        return None
    if job.eos_id is not None:
        return job.eos_id
    return None if run.tokenizer is None else run.tokenizer.eos


def _options(run: Run) -> TrainerOptions:
    job = run.job
    return TrainerOptions(
        dtype=getattr(torch, job.dtype), timeout=job.timeout,
        hidden=run.family.model.hidden(run.config),
        offload=job.offload if job.emulate is None else None, braid=job.braid,
        trace=job.trace is not None, clip_grad=job.clip_grad,
        lr_schedule=LRSchedule(job.lr_schedule, job.steps, job.warmup, job.min_lr),
        partition=run.built_partition, sequence_parallel=job.sequence_parallel,
        tp_overlap_chunks=job.tp_overlap_chunks if job.tp_overlap and job.tp > 1 else 0,
        shard_optimizer=job.shard_optimizer,
        overlap_grad_sync=job.overlap_grad_sync,
        overlap_param_gather=job.overlap_param_gather,
        recompute=job.recompute,
        compile=job.compile,
        document_eos=_document_eos(run),
    )


def run(resolved: Run,
        on_step: Callable[[StepReport], None] | None = None, *,
        on_compile: Callable[[float | None], None] | None = None) -> RunSummary | None:
    """Train the resolved run on the initialised world (see the module doc).
    `on_compile` (rank 0, with --compile): called with None as the first step, which
    compiles, starts, and with its compile seconds once it is done, so the caller
    can say what the silent minutes are."""
    job = resolved.job
    clock = Startup.from_env()  # time to first step (stp.train.run.startup)
    mesh = Mesh.from_world(ParallelDims(job.pp, job.tp, job.dp, job.ep), timeout=job.timeout)
    resolved = _shared_out(resolved)
    job, schedule = resolved.job, resolved.schedule
    if mesh.rank == 0:  # what a later --resume restores (stp.train.checkpoint.resume)
        write_settings(job, job.out_dir())
        write_data_record(job.out_dir(), data_fingerprint(data_options(job), resolved.tokenizer),
                          job.data)
    clock.at("workers")
    batches = resolved.family.batches(resolved)  # bytes, tokens, or images and captions
    evals, sharded = _eval_batches(resolved), None
    clock.at("data")
    if job.lr is None:  # resolve() fills in the family's default
        raise AssertionError("a resolved run has its --lr")
    model, optimizer = resolved.stage_model(), adamw(job.lr, weight_decay=job.weight_decay)
    options = _options(resolved)
    trainer = (Trainer.resume(job.resume, model, optimizer, schedule, mesh=mesh, options=options,
                              init_from=job.init_from, allow_unverified=job.allow_unverified)
               if job.resume else
               Trainer(model, optimizer, schedule, mesh=mesh, options=options,
                       init_from=job.init_from))
    clock.at("build")
    startup: dict[str, float] | None = None
    tokens_per_step = job.global_batch * job.model.seq_len
    losses: list[float] = []
    times: list[float] = []
    peaks: list[int] | None = None
    copies: list[int] | None = None  # what the DP reductions' copies added to them
    skips = SkipCounter(job.max_skipped_steps)  # a run that trains nothing stops
    compiling = 0.0  # seconds the steps spent compiling (--compile)
    flops = step_flops(resolved)
    peak = device_peak(mesh.device, job.dtype, job.hardware)
    tell = on_compile if job.compile and mesh.rank == 0 else None
    first_step = trainer.steps_done
    metrics = (MetricsLog(job.out_dir(), resumed_at=first_step,
                          tensorboard=job.log == "tensorboard") if mesh.rank == 0 else None)
    batches = Prefetched(batches, first_step, job.steps)  # built ahead on a thread
    for step in range(first_step, job.steps):
        if tell is not None and step == first_step:
            tell(None)
        compiled_before = compile_stats().seconds
        start = time.perf_counter()
        loss = trainer.step(batches.batch(step))
        elapsed = time.perf_counter() - start
        if not losses:  # the end of this process's first step
            clock.at("step")
            startup = clock.parts(compile_stats().seconds,
                                  compile_stats().seconds - compiled_before)
        compile_s = (_slowest(compile_stats().seconds - compiled_before, trainer.device)
                     if job.compile else None)
        compiling += compile_s or 0.0
        if tell is not None and step == first_step:
            tell(compile_s)
        losses.append(loss)
        times.append(elapsed)
        resident = trainer.activation_peaks()  # collective, outside the timed step
        if resident is not None:
            old = peaks or resident
            peaks = [max(a, b) for a, b in zip(old, resident, strict=True)]
            copies = [max(a, b) for a, b in zip(copies or trainer.copy_peaks,
                                                trainer.copy_peaks, strict=True)]
        update = trainer.last_update
        skips.update(update is not None and update.skipped, step + 1)
        eval_loss, saved = _after_step(job, trainer, step, evals)
        sharded = saved or sharded
        if metrics is not None and update is not None:  # global rank 0
            report = StepReport(step, loss, tokens_per_step / elapsed, elapsed, resident,
                                update.grad_norm, update.lr, update.skipped, eval_loss,
                                saved, trainer.last_figures or None, compile_s,
                                mfu_of(flops, elapsed, job.world_size, peak),
                                startup if len(losses) == 1 else None)
            metrics.write(report)
            if on_step is not None:
                on_step(report)
    batches.close()
    if metrics is not None:
        metrics.close()
    trainer.finish_param_gather()  # the model after the last step (--overlap-param-gather)
    if job.trace is not None and losses:  # the last step, every rank
        trainer.write_trace(job.trace, {"braid": job.braid, "emulate": job.emulate,
                                        "tp": job.tp, "dp": job.dp,
                                        "partition": resolved.layer_counts()})
    if job.save_hf is not None:  # every rank writes its own stages' files
        try:
            trainer.save_hf(job.save_hf)
            if mesh.rank == 0:
                copy_tokenizer(job.tokenizer, job.save_hf)
        except OSError as e:  # a full disk: one line naming the directory and the cause
            raise StorageFault(f"cannot write --save-hf {job.save_hf}: {cause_of(e)}; the "
                               f"sharded checkpoints in {job.out} are intact") from None
    if job.save_full is not None:  # every pipeline rank writes its own stages' tensors
        try:
            trainer.save_full(job.save_full)
        except StorageFault as e:  # on every rank: one line naming the file and the cause
            raise StorageFault(f"--save-full: {e}; the sharded checkpoints in {job.out} "
                               "are intact") from None
    memory = _measured_memory(trainer, peaks, mesh.rank, copies)  # collective
    parameters = trainer.parameter_count()  # collective; from shapes, nothing gathered
    if mesh.rank != 0:
        return None
    return RunSummary(
        job=job, microbatches=schedule.num_microbatches, backend=str(dist.get_backend()),
        device=str(mesh.device), parameters=parameters,
        losses=tuple(losses), step_times_s=tuple(times), tokens_per_step=tokens_per_step,
        resident_activation_bytes=peaks, checkpoint=sharded, memory=memory,
        compile_s=compiling if job.compile else None, step_flops=flops, peak=peak,
        startup=startup,
    )


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (collective): a step waits for the rank
    that compiles longest. On the run's device: NCCL reduces no CPU tensor."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _measured_memory(trainer: Trainer, peaks: list[int] | None, rank: int,
                     copies: list[int] | None = None) -> list[dict[str, int]] | None:
    """Every global rank's measured bytes by category (stp.train.run.memory_measure), with
    its pipeline rank, on global rank 0 (None elsewhere). Collective."""
    mine = measure(trainer, None if peaks is None else peaks[rank])
    mine["dp_copies"] = 0 if copies is None else copies[rank]
    mine["pp"] = trainer.mesh.coord.pp
    everyone: list[Any] = [None] * trainer.dims.world_size
    dist.all_gather_object(everyone, mine)
    return everyone if rank == 0 else None


def memory_summary(memory: list[dict[str, int]]) -> dict[str, Any]:
    """`--json`'s closing object's memory part, as `stp memory --json` gives it: the
    heaviest rank's categories, its pipeline rank, and every global rank's."""
    peak = max(memory, key=lambda m: m["total"])
    return {"memory": {k: peak[k] for k in (*CATEGORIES, "total")}, "peak_rank": peak["pp"],
            "ranks": memory}
