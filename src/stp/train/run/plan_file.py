"""`stp train --plan PLAN.json`: the settings of plan #1 of `stp plan --out`.

A plan row's `job` object names `TrainJob` fields (`stp.plan.report.job_fields`):
the mesh (a mixture of experts' ep too), the schedule, the partition, the
microbatching, the sequence length, the dtype, and the memory levers the
plan turned on. Each is checked
for its type here and for its meaning by the usual checks of the job
(`stp.train.run.job.check`), as if given as a flag. A field this build of `stp
train` does not have (a lever added in a later version) is refused in one
line naming the flag, not dropped: the plan's memory figure counted on it.
A flag given on the command line too must agree with the plan.

The model: a format 2 plan (this stp's `stp plan --out`) records the model it
was made for, as its jobs' `model_name` (`stp train --model`: a preset, or a
config.json's absolute path) and the top-level `model` object (`preset`, or
`config` with the file's `sha256`). The run trains that model (randomly
initialised; `--init-from DIR` of the same shape brings weights); a config.json
that changed since planning is refused, and a `--model` given on the command
line must describe the same shape (the refusal lists the fields that differ).
A format 1 plan (older stp) carries no model: it is read as before, and
`with_plan` notes that the model is the one the flags describe.

The file may be hostile: read bounded (`stp.files.read_json_object`), every
value typed and ranged before use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stp.files import read_json_object
from stp.train.run.config import ModelShape, TrainJob

__all__ = ["with_plan", "PLAN_KEYS", "MAX_PLAN_BYTES", "FORMATS"]

MAX_PLAN_BYTES = 16 << 20
FORMATS = (1, 2)
"""Plan layouts read: 1 (no model), 2 (the model recorded)."""
PLAN_KEYS: dict[str, type] = {
    "model_name": str, "pp": int, "tp": int, "dp": int, "schedule": str, "microbatches": int,
    "microbatch_size": int, "seq_len": int, "dtype": str, "partition": str,
    "sequence_parallel": bool, "recompute": str, "shard_optimizer": bool, "offload": str,
    "ep": int, "braid": bool, "tp_overlap": bool, "tp_overlap_chunks": int,
}
"""The settings a plan may carry, and their JSON types."""
_NESTED = {"seq_len"}
"""Settings that live in the job's model shape (`ModelShape`)."""


def _flag(key: str) -> str:
    return {"microbatches": "-m", "model_name": "--model"}.get(
        key, "--" + key.replace("_", "-"))


def _row(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plan document, plan #1's job)."""
    doc = read_json_object(path, MAX_PLAN_BYTES)
    plans = doc.get("plans")
    fmt = doc.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > max(FORMATS):
        raise ValueError(f"--plan {path}: plan format {fmt} is newer than this stp reads "
                         f"({', '.join(map(str, FORMATS))}); update stp or re-plan with it")
    if fmt not in FORMATS or isinstance(fmt, bool) or not isinstance(plans, list) or not plans:
        raise ValueError(f"--plan {path}: not a plan of `stp plan --out` (format 1 or 2 with "
                         "a non-empty `plans` list expected)")
    job = plans[0].get("job") if isinstance(plans[0], dict) else None
    if not isinstance(job, dict):
        raise ValueError(f"--plan {path}: plan #1 has no `job` object")
    if fmt == 1 and "model_name" in job:
        raise ValueError(f"--plan {path}: a format 1 plan carries no model_name; re-plan "
                         "with this stp")
    if fmt == 2 and not isinstance(job.get("model_name"), str):
        raise ValueError(f"--plan {path}: plan #1's job names no model (model_name); "
                         "re-plan with `stp plan --out`")
    return doc, job


def _check_config_file(path: str, doc: dict[str, Any], name: str) -> None:
    """A plan made for a config.json: the file is still there and unchanged."""
    from stp.train.run.model_source import file_sha256, is_preset

    if is_preset(name):
        return
    model = doc.get("model")
    want = model.get("sha256") if isinstance(model, dict) else None
    if not isinstance(want, str) or model.get("config") != name:  # type: ignore[union-attr]  # `want` is a str only when `model` is a dict
        raise ValueError(f"--plan {path}: its `model` object does not name {name!r} with "
                         "its sha256; re-plan with `stp plan --out`")
    try:
        have = file_sha256(name)
    except OSError as e:
        raise ValueError(f"--plan {path} was made for {name}, which cannot be read "
                         f"({e.strerror or e}); put it back or re-plan") from None
    if have != want:
        raise ValueError(f"--plan {path} was made for {name}, which has changed since "
                         f"(sha256 {have[:12]}.., the plan says {want[:12]}..); re-plan")


def _model_agrees(path: str, planned: str, given: str) -> None:
    """`--model given` must describe the plan's model (one line of the differences)."""
    from stp.train.run.model_source import differences, shape_of

    if given == planned:
        return
    differ = differences(shape_of(given), shape_of(planned))
    if differ:
        raise ValueError(f"--model {given} disagrees with --plan {path}, made for {planned}: "
                         f"{', '.join(differ)} (--model vs the plan's); drop --model or "
                         "re-plan")


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


def with_plan(job: TrainJob, notes: list[str] | None = None) -> TrainJob:
    """`job` with plan #1's settings; ValueError (one line) for a bad file, a
    setting this build lacks, or a flag that disagrees with the plan. `notes`
    gets what the user should be told (a format 1 plan carries no model)."""
    assert job.plan is not None
    doc, row = _row(job.plan)
    settings = _checked(job.plan, row)
    default, default_shape = TrainJob(), ModelShape()
    top: dict[str, Any] = {}
    shape: dict[str, Any] = {}
    planned = settings.pop("model_name", None)
    if planned is None:
        if notes is not None:
            notes.append(f"--plan {job.plan} is a format 1 plan and carries no model: "
                         "training the model the flags describe (re-plan with this stp "
                         "to record it)")
    else:
        _check_config_file(job.plan, doc, planned)
        if job.model_name is not None:
            _model_agrees(job.plan, planned, job.model_name)
        else:
            top["model_name"] = planned
    for key, val in settings.items():
        have, was = ((getattr(job.model, key), getattr(default_shape, key)) if key in _NESTED
                     else (getattr(job, key), getattr(default, key)))
        if have != was and have != val:
            raise ValueError(f"{_flag(key)} {have} disagrees with --plan {job.plan} "
                             f"({key}={val}); drop the flag or the plan")
        (shape if key in _NESTED else top)[key] = val
    return dataclasses.replace(job, model=dataclasses.replace(job.model, **shape), **top)
