"""The registry of model families `stp train` and the Trainer know.

A family is its model half (`stp.models.<family>`, behind the
`stp.models.family.ModelFamily` protocol: build a stage, check a batch, the
reference, the cost model's spec) and its job half here (`TrainFamily`: the
config a `stp train` run's flags describe, the flags it refuses, its data).
Nothing in `stp.train`, `stp.cli` or `stp.runtime` tests a config's class:
they ask `family_named(job.arch)` or `family_of(config)`.

Adding a family: a package `stp.models.<name>` (and its config in
`stp.shapes`), a module `stp.train.families.<name>` with `FAMILY`, and one
line in `MODULES` (stp.train.families.registry, which names modules rather than
importing them so that the flags can list the `--arch` choices without loading a
model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from stp.train.families.registry import EARLY_TP_CHECKS, MODULES

if TYPE_CHECKING:
    from stp.models.family import ModelFamily
    from stp.train.data.tokens import Tokenizer
    from stp.train.run.config import TrainJob

__all__ = ["EARLY_TP_CHECKS", "MODULES", "RunInputs", "TrainFamily", "family_named",
           "family_of"]

class RunInputs(Protocol):
    """What a family reads of a resolved run for its data (stp.train.run.resolve.Run)."""

    @property
    def job(self) -> TrainJob: ...
    @property
    def config(self) -> Any: ...
    @property
    def tokenizer(self) -> Tokenizer | None: ...


class TrainFamily(Protocol):
    """What `stp train` needs of a family beyond its model (see the module doc)."""

    name: str
    model: ModelFamily

    def check_flags(self, job: TrainJob) -> None:
        """ValueError naming a flag this family does not take (before anything is read)."""

    def config(self, job: TrainJob, tokenizer: Tokenizer | None) -> Any:
        """The model the job's flags (or its --init-from checkpoint) describe."""

    def check_run(self, job: TrainJob, config: Any, schedule: Any) -> None:
        """ValueError unless `config` fits the job's mesh and `schedule` (and the
        family's own inputs, e.g. an image folder, are readable)."""

    def batches(self, run: RunInputs) -> Any:
        """The run's global batches: `.batch(step)` -> (inputs, targets)."""

    def eval_batches(self, run: RunInputs) -> Any | None:
        """The held-out batches of --eval-every, in order; None: nothing to evaluate."""


def family_named(arch: str) -> TrainFamily:
    """The family `--arch arch` names; ValueError listing the names for another."""
    if arch not in MODULES:
        raise ValueError(f"--arch {arch!r}: choose one of {', '.join(MODULES)}")
    return importlib.import_module(MODULES[arch]).FAMILY


def family_of(config: object) -> TrainFamily | None:
    """The family whose config `config` is (its exact class); None for anything else
    (a stage builder)."""
    for name in MODULES:
        family = family_named(name)
        if type(config) is family.model.config_type:
            return family
    return None
