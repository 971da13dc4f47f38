"""What a Trainer holds, measured, in the categories `stp memory` estimates.

Bytes of the live tensors of this rank, each counted once (by storage):

    weights           the model's parameters (the compute dtype)
    grads             the whole gradients: fp32 main grads in a 16-bit run
                      (stp.train.step.precision), else the parameters' .grad
    masters           the fp32 master weights of a 16-bit run (0 otherwise);
                      with the sharded optimizer (stp.train.step.zero) this rank's
                      shard of them
    optimizer         the optimizer's state tensors (AdamW: two moments per
                      parameter, and its step counters): with the sharded
                      optimizer, of this rank's shards
    activations_peak  the largest resident activation bytes of a step
                      (stp.runtime.offload's StepMemory: what the stage graphs
                      hold between a forward and its backward)

The same definitions as `stp.costmodel.memory` (whose `buffers`, receive and
collective buffers, are not measured here, except the DP reductions' gradient
copies: `stp.train.run.loop` adds `dp_copies`, what they added to the peak of
resident activations, StepMemory.peak_with_held), so `stp memory` can be checked
against a run (benchmarks/bench_memory.py). Counting by storage is what makes
the figures true to the bytes held: a parameter that is a view of a larger
tensor keeps all of it (this found random-init TP shards holding their whole
unsharded matrix, stp.models.decoder.init.init_shard, since fixed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the Trainer's module imports the loop that imports this
    from stp.train.step.trainer import Trainer

__all__ = ["CATEGORIES", "measure"]

CATEGORIES = ("weights", "grads", "masters", "optimizer", "activations_peak")


def _bytes(tensors: Any, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def measure(trainer: Trainer, activations_peak: int | None) -> dict[str, int]:
    """This rank's bytes per category (the module doc); `activations_peak` from the
    run's StepMemory (None: not measured, counted 0)."""
    seen: set[int] = set()
    model = [p for _, p in trainer.named_parameters()]
    precision = trainer.parts.precision
    weights = _bytes(model, seen)
    masters = _bytes(precision.params, seen) if precision.mixed else 0
    grads = _bytes(precision.grad_buffers(), seen)
    state = (v for s in trainer.optimizer.state.values() for v in s.values())
    optimizer = _bytes(state, seen)
    out = {"weights": weights, "grads": grads, "masters": masters, "optimizer": optimizer,
           "activations_peak": int(activations_peak or 0)}
    out["total"] = sum(out[k] for k in CATEGORIES)
    return out
