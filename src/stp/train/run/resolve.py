"""A `stp train` job resolved once into the run it describes.

`resolve(job)` reads what the flags point at (a schedule file, a Hugging Face
checkpoint's config.json and tensor headers, a tokenizer) and decides what
they leave open (the schedule, the model's config, the layers of each global
stage, the tokenizer), once. The loop, the Trainer and the reports read the
frozen `Run` it returns, never the flags again; `stp train` resolves in the
launching process and hands the `Run` to its workers.

Where is the partition decided? Here: `--partition L0,L1,..` is checked
against the model's layers and the schedule's stages, `--partition auto` asks
the simulator for the partition with the shortest step under costs derived
from the model's shape (the family's cost spec; `stp.search.partition`),
priced on the run's own tensor-parallel size and on the `AUTO_HARDWARE`
preset: only the ratio of one layer's cost to another's (and to the output
layer's) matters for the choice, and that ratio is the model's, not the
machine's. The run's job carries the chosen counts, so reports name them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stp.schedule import Schedule
from stp.schedule.placement import partition_layers
from stp.sim.layered import check_partition, parse_partition
from stp.train.checkpoint.resume import restore_settings, run_dir_of
from stp.train.checkpoint.sharded import latest, read_info
from stp.train.data.load import data_fingerprint, data_options
from stp.train.data.record import check_data_unchanged
from stp.train.data.tokens import Tokenizer, run_tokenizer
from stp.train.families import TrainFamily, family_named, family_of
from stp.train.run.config import TrainJob, default_lr
from stp.train.run.schedules import job_schedule

if TYPE_CHECKING:  # imported in trainer_options: a run only priced (stp memory) does without
    from stp.train.run.parts import TrainerOptions

__all__ = ["AUTO_HARDWARE", "Run", "resolve"]

AUTO_HARDWARE = "a100-80g"
"""The hardware preset `--partition auto` prices layers on (see the module doc)."""


@dataclass(frozen=True)
class Run:
    """One `stp train` run, resolved (see the module doc)."""

    job: TrainJob
    """The flags, with `-m` of a schedule file and `--partition auto`'s counts filled in."""
    family: TrainFamily
    config: Any
    """The model's config (stp.shapes)."""
    schedule: Schedule
    partition: tuple[int, ...] | None
    """Layers of each global stage; None: the even split."""
    tokenizer: Tokenizer | None
    """The tokenizer of the text; None: bytes (or no text)."""
    resumed: Path | None = None
    """The checkpoint `--resume` loads (None: a fresh start)."""
    resumed_step: int = 0
    """The steps that checkpoint has trained."""

    def stage_model(self) -> Any:
        """What the Trainer builds stages from: the model's config, or with
        `--emulate-compute` stages that wait instead of computing."""
        if self.job.emulate is None:
            return self.config
        from stp.models.emulated import emulated_builder, parse_emulate

        return emulated_builder(parse_emulate(self.job.emulate), self.schedule.chunks,
                                self.family.model.num_layers(self.config),
                                self.family.model.hidden(self.config))

    def trainer_options(self) -> TrainerOptions:
        """How the Trainer runs this run: the one slice of the flags it reads (the
        runtime's slice follows from it, TrainerOptions.executor_options)."""
        import torch

        from stp.train.run.parts import TrainerOptions
        from stp.train.step.lr import LRSchedule

        job = self.job
        return TrainerOptions(
            dtype=getattr(torch, job.dtype), timeout=job.timeout,
            hidden=self.family.model.hidden(self.config),
            offload=job.offload if job.emulate is None else None, braid=job.braid,
            trace=job.trace is not None, clip_grad=job.clip_grad,
            lr_schedule=LRSchedule(job.lr_schedule, job.steps, job.warmup, job.min_lr),
            partition=self.built_partition, sequence_parallel=job.sequence_parallel,
            tp_overlap_chunks=job.tp_overlap_chunks if job.tp_overlap and job.tp > 1 else 0,
            shard_optimizer=job.shard_optimizer, overlap_grad_sync=job.overlap_grad_sync,
            overlap_param_gather=job.overlap_param_gather, recompute=job.recompute,
            compile=job.compile, document_eos=self.document_eos)

    @property
    def document_eos(self) -> int | None:
        """--document-mask's end-of-sequence id: --eos-id, else the tokenizer's."""
        if not self.job.document_mask:
            return None
        if self.job.eos_id is not None:
            return self.job.eos_id
        return None if self.tokenizer is None else self.tokenizer.eos

    @property
    def built_partition(self) -> tuple[int, ...] | None:
        """The partition the stages are built with (an emulated run: none)."""
        return None if self.job.emulate is not None else self.partition

    def layer_counts(self) -> list[int]:
        """Layers of each global stage as the run builds them (for trace readers)."""
        layers = self.family.model.num_layers(self.config)
        return [len(r) for r in partition_layers(layers, self.schedule.num_stages,
                                                 self.built_partition)]


def resolve(job: TrainJob, config: object = None) -> Run:
    """The run `job` describes; ValueError (one line, naming the flag) for a schedule,
    model, partition, tokenizer or checkpoint to resume that does not fit.
    `config`: the model's config when the caller has read it already (`stp
    memory` reads only --init-from's config.json, never the weights' headers).

    `--resume DIR` restores the model settings the resumed run recorded
    (stp.train.checkpoint.resume) and, unless `--out` says otherwise, goes on writing in the
    directory holding its checkpoints."""
    resumed, resumed_step = None, 0
    if job.resume is not None:
        resumed = latest(job.resume)  # ValueError naming the path when there is none
        resumed_step = int(read_info(resumed).get("step", 0))
        job = restore_settings(job, run_dir_of(resumed))
        if job.out is None:
            job = dataclasses.replace(job, out=str(run_dir_of(resumed)))
    schedule = job_schedule(job)  # a name, or a file checked against the mesh
    family = family_named(job.arch)
    family.check_flags(job)
    tokenizer = run_tokenizer(job.tokenizer, job.init_from)
    if resumed is not None:  # other data would give other batches
        check_data_unchanged(run_dir_of(resumed), data_fingerprint(data_options(job), tokenizer),
                             job.data, job.data_changed_ok)
    if config is None:
        config = _config(job, family, tokenizer)
    # an --init-from checkpoint's config.json decides the family (a Mixtral is an MoE)
    family = family_of(config) or family
    family.check_run(job, config, schedule)
    if job.lr is None:  # the default of the width actually trained (--init-from's too)
        job = dataclasses.replace(job, lr=default_lr(family.model.hidden(config)))
    partition = _partition(job, family, config, schedule)
    if partition is not None:
        job = dataclasses.replace(job, partition=",".join(map(str, partition)))
    return Run(job=job, family=family, config=config, schedule=schedule, partition=partition,
               tokenizer=tokenizer, resumed=resumed, resumed_step=resumed_step)


def _config(job: TrainJob, family: TrainFamily, tokenizer: Tokenizer | None) -> Any:
    """The model the job trains: `--model`'s shape, randomly initialised
    (stp.train.run.model_source), or what the family's flags (or `--init-from`)
    describe; with both `--model` and `--init-from`, the checkpoint's, once the
    two agree."""
    name = job.model_name
    if name is None:
        return family.config(job, tokenizer)
    from stp.train.run import model_source

    if job.init_from is not None:
        config = family.config(job, tokenizer)
        from stp.costmodel.configs import spec_from_config

        have = spec_from_config(config, seq_len=job.model.seq_len)
        differ = model_source.differences(model_source.shape_of(name), have,
                                          model_source.CORE_FIELDS)
        if differ:
            raise ValueError(f"--model {name} is not the --init-from {job.init_from!r} "
                             f"checkpoint's shape ({', '.join(differ)}); drop --model")
        return config
    config = model_source.model_config(name, job.model.seq_len, job.seed)
    model_source.check_shape_flags(job.model, config, name)
    return config


def _partition(job: TrainJob, family: TrainFamily, config: object,
               schedule: Schedule) -> tuple[int, ...] | None:
    """The layers of each global stage `--partition` asks for (None: even)."""
    if job.partition is None:
        return None
    layers = family.model.num_layers(config)
    part = parse_partition(job.partition)
    if isinstance(part, tuple):
        return check_partition(part, schedule.num_stages, layers)
    if layers < schedule.num_stages:
        raise ValueError(f"--partition auto: the model's {layers} layers cannot "
                         f"fill the schedule's {schedule.num_stages} stages")
    return _auto(job, family, config, schedule)


def _auto(job: TrainJob, family: TrainFamily, config: object,
          schedule: Schedule) -> tuple[int, ...]:
    from stp.costmodel import HARDWARE, derive
    from stp.costmodel.stages import layered_costs
    from stp.search.partition import auto_partition

    spec = family.model.cost_spec(config, sequence=job.model.seq_len,
                                  micro_batch=job.microbatch_size, tp=job.tp)
    hw = HARDWARE[AUTO_HARDWARE]
    # pp only sets the memory unit (one rank's share) of the tables, not a time, and
    # the search has no memory limit, so the choice does not depend on it
    d = derive(spec, hw, job.pp)
    layered = layered_costs(spec, hw, job.pp, d.costs, d.mem)
    return auto_partition(schedule, layered, family.model.num_layers(config)).counts
