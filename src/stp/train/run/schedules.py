"""The schedule one `stp train` run executes: a registry schedule or a schedule file.

A schedule file (`--schedule FILE.json|FILE.csv`: what `stp search --out`
and `stp export` write, or hand-edited) is read, validated (every pass
once, dependencies acyclic) and checked against the mesh: its pipeline ranks
must be `--pp`, its microbatch count `-m` when given (else `-m` is the
file's).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stp.schedule import Schedule, registry
from stp.train.run.config import TrainJob

__all__ = ["is_schedule_file", "load_schedule_file", "with_schedule_file", "job_schedule"]

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
