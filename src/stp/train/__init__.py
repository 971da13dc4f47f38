"""The application layer: training runs built on the runtime and the models.

Rooms:
- `run/`: one run's settings (`TrainJob`), their checks, its set-up and loop.
- `step/`: one training step: the `Trainer`, gradient collectives, clipping,
  precision, learning rate, the sharded optimizer.
- `checkpoint/`: sharded checkpoints any mesh resumes from, their checksums,
  the whole model as one file.
- `data/`: the byte-level corpus, tokenised text, image-caption pairs.
- `families/`: what the trainer needs from each model family.

The names a newcomer uses are importable from here (`from stp.train import
Trainer`); they load on first use, so `stp train --help` stays free of torch.
"""
from importlib import import_module

# public name -> the module that defines it (loaded on first access)
_PUBLIC = {
    "Trainer": "stp.train.step.trainer",
    "TrainerOptions": "stp.train.run.parts",
    "TrainJob": "stp.train.run.config",
    "ModelShape": "stp.train.run.config",
    "LRSchedule": "stp.train.step.lr",
    "adamw": "stp.train.step.lr",
    "ByteBatches": "stp.train.data.corpus",
    "read_corpus": "stp.train.data.corpus",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'stp.train' has no attribute {name!r}")
    return getattr(import_module(module), name)
