"""What one `stp train` run executes: a registry schedule or a schedule file,
and how the model's layers are cut into its global stages.

A schedule file (`--schedule FILE.json|FILE.csv`: what `stp search --out`
and `stp export` write, or hand-edited) is read, validated (every pass
once, dependencies acyclic) and checked against the mesh: its pipeline ranks
must be `--pp`, its microbatch count `-m` when given (else `-m` is the
file's). `--partition` gives each global stage its layers: explicit counts
summing to the model's layers, or `auto`, the partition with the shortest
simulated step under costs derived from the model's shape
(`stp.search.partition`; FLOPs and bytes from `stp.costmodel`, on the
default hardware preset: only the ratio of a layer to the output layer
matters for the choice; `--arch mllm`: vision blocks first, then decoder
layers, priced by the multimodal cost model, stp.train.mllm_plan).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stp.models import ModelConfig
from stp.models.mllm_config import MLLMConfig
from stp.schedule import Schedule, registry
from stp.sim.layered import check_partition, parse_partition
from stp.train.config import TrainJob

__all__ = ["is_schedule_file", "load_schedule_file", "with_schedule_file", "job_schedule",
           "job_partition"]

SUFFIXES = (".json", ".csv")


def is_schedule_file(name: str) -> bool:
    """Whether `--schedule` names a file (by its suffix) rather than a generator."""
    return Path(name).suffix.lower() in SUFFIXES


def load_schedule_file(path: str, pp: int, microbatches: int | None = None) -> Schedule:
    """The validated schedule in file `path`, fitted to `pp` pipeline ranks;
    ValueError (one line) naming the file and what does not fit."""
    from stp.schedule import io

    flag = f"--schedule {path}"
    try:
        if Path(path).suffix.lower() == ".json":
            sch = io.load_json(Path(path))
        else:
            sch = io.load_csv(Path(path), num_microbatches=microbatches)
    except ValueError as e:
        raise ValueError(f"{flag}: {str(e).splitlines()[0]}") from None
    if sch.num_ranks != pp:
        raise ValueError(f"{flag} has {sch.num_ranks} pipeline ranks but --pp is {pp}; "
                         f"give --pp {sch.num_ranks} or a schedule for {pp} ranks")
    if microbatches is not None and microbatches != sch.num_microbatches:
        raise ValueError(f"{flag} runs {sch.num_microbatches} microbatches but -m is "
                         f"{microbatches}; leave -m out to take the file's")
    return sch


def with_schedule_file(job: TrainJob) -> TrainJob:
    """`job` with -m taken from its schedule file when -m was left out (the
    global batch is dp x m x microbatch size); unchanged for a schedule name."""
    if not is_schedule_file(job.schedule) or job.microbatches is not None:
        return job
    sch = load_schedule_file(job.schedule, job.pp)
    return dataclasses.replace(job, microbatches=sch.num_microbatches)


def job_schedule(job: TrainJob) -> Schedule:
    """The schedule `job` runs: its file, or the registry's for the name."""
    if is_schedule_file(job.schedule):
        return load_schedule_file(job.schedule, job.pp, job.microbatches)
    if job.schedule not in registry.names():
        raise ValueError(f"--schedule {job.schedule!r}: invalid choice; choose one of "
                         f"{', '.join(registry.names())}, or a schedule file "
                         "FILE.json|FILE.csv")
    return registry.make(job.schedule, job.pp, job.num_microbatches)


def job_partition(job: TrainJob, config: ModelConfig | MLLMConfig,
                  schedule: Schedule) -> tuple[int, ...] | None:
    """The layers of each global stage `--partition` asks for (None: even); for
    --arch mllm vision blocks first, then decoder layers (stp.train.mllm_plan)."""
    if job.partition is None:
        return None
    part = parse_partition(job.partition)
    if isinstance(part, tuple):
        return check_partition(part, schedule.num_stages, config.num_layers)
    if isinstance(config, MLLMConfig):  # vision blocks first, then decoder layers
        from stp.train.mllm_plan import mllm_auto_partition

        return mllm_auto_partition(job, config, schedule)
    if config.num_layers < schedule.num_stages:
        raise ValueError(f"--partition auto: the model's {config.num_layers} layers cannot "
                         f"fill the schedule's {schedule.num_stages} stages")
    return _auto(job, config, schedule)


def _auto(job: TrainJob, config: ModelConfig, schedule: Schedule) -> tuple[int, ...]:
    from stp.costmodel import HARDWARE, ModelSpec, derive
    from stp.costmodel.stages import layered_costs
    from stp.search.partition import auto_partition

    spec = ModelSpec(
        layers=config.num_layers, hidden=config.num_heads * config.head_dim,
        heads=config.num_heads, kv_heads=config.num_kv_heads, ffn=config.ffn,
        vocab=config.vocab_size, sequence=job.model.seq_len, micro_batch=job.microbatch_size,
        tp=1, gated_mlp=True,
    )
    hw = HARDWARE["a100-80g"]
    d = derive(spec, hw, job.pp)
    layered = layered_costs(spec, hw, job.pp, d.costs, d.mem)
    return auto_partition(schedule, layered, config.num_layers).counts


def resolved_partition(job: TrainJob,
                       schedule: Schedule) -> tuple[TrainJob, tuple[int, ...] | None]:
    """(`job` with `auto` replaced by the counts it chose, so reports name them;
    the layers of each global stage, None: even)."""
    if job.partition is None or job.emulate is not None:
        return job, None
    from stp.train.job import model_config

    counts = job_partition(job, model_config(job), schedule)
    assert counts is not None
    return dataclasses.replace(job, partition=",".join(map(str, counts))), counts


def stage_layer_counts(job: TrainJob, schedule: Schedule) -> list[int]:
    """Layers of each global stage as the run built them (for trace readers)."""
    from stp.schedule.placement import partition_layers
    from stp.train.job import model_config

    config = model_config(job)
    counts = None
    if job.partition is not None and job.emulate is None:
        counts = job_partition(job, config, schedule)
    return [len(r) for r in partition_layers(config.num_layers, schedule.num_stages, counts)]
