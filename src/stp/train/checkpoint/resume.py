"""`stp train --resume DIR` as users of torchtitan and the Hugging Face Trainer
expect it: the run goes on writing into DIR, and the flags that define the
model need not be repeated.

Every run writes its model-defining settings to `RUN_FILE` in its `--out`
directory before its first step (`write_settings`). Resuming reads them back
(`restore_settings`): a setting left at its default takes the saved value, a
setting given with another value is refused by its own flag name (a model
with another shape cannot load the checkpoint's tensors, and another
tokenizer would read its token ids as other tokens). Everything else (the
mesh, the schedule, the learning rate, the number of steps) may change on a
resume: the sharded checkpoints load onto any mesh.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stp.files import read_json, write_text_atomic
from stp.train.run.config import ModelShape, MoEShape, TrainJob, VisionShape

__all__ = ["RUN_FILE", "MODEL_SETTINGS", "restore_settings", "run_dir_of", "write_settings"]

RUN_FILE = "run.json"
MODEL_SETTINGS = ("arch", "init_from", "tokenizer", "model_name")
"""Top-level TrainJob fields that define the model (with `model`, `vision` and `moe`)."""
_NESTED = {"model": ModelShape, "vision": VisionShape, "moe": MoEShape}


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint `DIR/step-N` was written in."""
    return checkpoint.parent


def write_settings(job: TrainJob, out: Path) -> None:
    """Record `job`'s model-defining settings in `out/RUN_FILE` (atomically)."""
    saved: dict[str, Any] = {k: getattr(job, k) for k in MODEL_SETTINGS}
    for name in _NESTED:
        saved[name] = dataclasses.asdict(getattr(job, name))
    write_text_atomic(out / RUN_FILE, json.dumps({"settings": saved}, indent=1) + "\n")


def _flag(name: str) -> str:
    return "--model" if name == "model_name" else "--" + name.replace("_", "-")


def _merge(field: str, given: Any, default: Any, saved: Any, where: Path) -> Any:
    kinds = {type(v) for v in (given, default) if v is not None}
    if saved is not None and (isinstance(saved, bool) or type(saved) not in kinds) and kinds:
        # a damaged or edited run.json is refused, never loaded as some other model
        raise ValueError(f"{where}: {_flag(field)} is {saved!r}, not a "
                         f"{' or '.join(sorted(k.__name__ for k in kinds))}; fix or remove the "
                         "file to resume without it")
    if given in (default, saved):
        return saved
    shown = "(none)" if saved is None else saved
    raise ValueError(f"{_flag(field)} {given} contradicts the run being resumed ({where} has "
                     f"{_flag(field)} {shown}); drop {_flag(field)}")


def restore_settings(job: TrainJob, run_dir: Path) -> TrainJob:
    """`job` with the model settings of the run in `run_dir` restored (see the module
    doc); unchanged when the run recorded none (a checkpoint from before they were)."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        return job
    doc = read_json(path, 1 << 20)
    saved = doc.get("settings") if isinstance(doc, dict) else None
    if not isinstance(saved, dict):
        raise ValueError(f"{str(path)!r} holds no run settings; remove it to resume without them")
    defaults, changes = TrainJob(), {}
    for field in MODEL_SETTINGS:
        changes[field] = _merge(field, getattr(job, field), getattr(defaults, field),
                                saved.get(field), path)
    for name, cls in _NESTED.items():
        nested = saved.get(name)
        kept = nested if isinstance(nested, dict) else {}
        given, default = getattr(job, name), cls()
        values = {f.name: _merge(f.name, getattr(given, f.name), getattr(default, f.name),
                                 kept.get(f.name, getattr(given, f.name)), path)
                  for f in dataclasses.fields(cls)}
        changes[name] = cls(**values)
    return dataclasses.replace(job, **changes)
