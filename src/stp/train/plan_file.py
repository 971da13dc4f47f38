"""`stp train --plan PLAN.json`: the settings of plan #1 of `stp plan --out`.

A plan row's `job` object names `TrainJob` fields (`stp.plan.report.job_fields`):
the mesh (a mixture of experts' ep too), the schedule, the partition, the
microbatching, the sequence length, the dtype, and the memory levers the
plan turned on. Each is checked
for its type here and for its meaning by the usual checks of the job
(`stp.train.job.check`), as if given as a flag. A field this build of `stp
train` does not have (a lever added in a later version) is refused in one
line naming the flag, not dropped: the plan's memory figure counted on it.
A flag given on the command line too must agree with the plan.

The file may be hostile: read bounded (`stp.files.read_json_object`), every
value typed and ranged before use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stp.files import read_json_object
from stp.train.config import ModelShape, TrainJob

__all__ = ["with_plan", "PLAN_KEYS", "MAX_PLAN_BYTES"]

MAX_PLAN_BYTES = 16 << 20
PLAN_KEYS: dict[str, type] = {
    "pp": int, "tp": int, "dp": int, "schedule": str, "microbatches": int,
    "microbatch_size": int, "seq_len": int, "dtype": str, "partition": str,
    "sequence_parallel": bool, "recompute": str, "shard_optimizer": bool, "offload": str,
    "ep": int,
}
"""The settings a plan may carry, and their JSON types."""
_NESTED = {"seq_len"}
"""Settings that live in the job's model shape (`ModelShape`)."""


def _flag(key: str) -> str:
    return "-m" if key == "microbatches" else "--" + key.replace("_", "-")


def _row(path: str) -> dict[str, Any]:
    doc = read_json_object(path, MAX_PLAN_BYTES)
    plans = doc.get("plans")
    if doc.get("format") != 1 or not isinstance(plans, list) or not plans:
        raise ValueError(f"--plan {path}: not a plan of `stp plan --out` (format 1 with a "
                         "non-empty `plans` list expected)")
    job = plans[0].get("job") if isinstance(plans[0], dict) else None
    if not isinstance(job, dict):
        raise ValueError(f"--plan {path}: plan #1 has no `job` object")
    return job


def _checked(path: str, job: dict[str, Any]) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(TrainJob)} | _NESTED
    out = {}
    for key, val in job.items():
        kind = PLAN_KEYS.get(key) if isinstance(key, str) else None
        if kind is None:
            raise ValueError(f"--plan {path}: unknown setting {str(key)[:40]!r}; a plan sets "
                             f"{', '.join(PLAN_KEYS)}")
        if key not in fields:
            raise ValueError(f"--plan {path}: the plan needs {_flag(key)}, which this build "
                             "of stp train does not have; update stp or plan without it")
        ok = isinstance(val, kind) and (kind is bool or not isinstance(val, bool))
        if not ok or (kind is int and not 1 <= val <= 1 << 24) or (
                kind is str and not (val.isascii() and 0 < len(val) <= 4096)):
            raise ValueError(f"--plan {path}: {key}={repr(val)[:40]} is not a valid "
                             f"{kind.__name__} for {_flag(key)}")
        _in_range(path, key, val)
        out[key] = val
    return out


def _in_range(path: str, key: str, val: Any) -> None:
    """The bounds and choices the flag itself would enforce (`option(...)`)."""
    cls = ModelShape if key in _NESTED else TrainJob
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == key)
    lo, hi, choices = meta.get("minimum"), meta.get("maximum"), meta.get("choices")
    if (choices and val not in choices) or (lo is not None and val < lo) or (
            hi is not None and val > hi):
        accepted = ", ".join(choices) if choices else f"{lo:g} to {hi if hi else 'any':}"
        raise ValueError(f"--plan {path}: {key}={repr(val)[:40]} not accepted by "
                         f"{_flag(key)} ({accepted})")


def with_plan(job: TrainJob) -> TrainJob:
    """`job` with plan #1's settings; ValueError (one line) for a bad file, a
    setting this build lacks, or a flag that disagrees with the plan."""
    assert job.plan is not None
    settings = _checked(job.plan, _row(job.plan))
    default, default_shape = TrainJob(), ModelShape()
    top: dict[str, Any] = {}
    shape: dict[str, Any] = {}
    for key, val in settings.items():
        have, was = ((getattr(job.model, key), getattr(default_shape, key)) if key in _NESTED
                     else (getattr(job, key), getattr(default, key)))
        if have != was and have != val:
            raise ValueError(f"{_flag(key)} {have} disagrees with --plan {job.plan} "
                             f"({key}={val}); drop the flag or the plan")
        (shape if key in _NESTED else top)[key] = val
    return dataclasses.replace(job, model=dataclasses.replace(job.model, **shape), **top)
