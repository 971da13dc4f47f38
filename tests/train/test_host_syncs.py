"""A training step reads the device once: the loss, the gradient norm (whose
finiteness decides the inf/NaN skip) and the auxiliary figures come back in one
host synchronisation at the end of the step (issue 35: at most one per step).

Counted from the Python side, so the count is the same on any device: every
`item`, `tolist`, `cpu`, `numpy` and Python conversion (`float`, `int`, `bool`)
of a tensor during `Trainer.step`, seen by a TorchFunctionMode. Reads of the
batch the caller handed in (host memory: not a device read) are left out.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stp.bench.host_reads import HostReads
from stp.models import ModelConfig
from stp.train.step.lr import adamw
from stp.train.step.trainer import Trainer

CONFIG = ModelConfig(hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16)
def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (8, 17),
                        generator=torch.Generator().manual_seed(step))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _reads(trainer: Trainer, batch: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
    with HostReads(batch) as mode:
        trainer.step(batch)
    return mode.reads


@pytest.mark.parametrize("dtype,clip", [(torch.float32, None), (torch.bfloat16, 1.0)])
def test_one_host_sync_per_step(dtype: torch.dtype, clip: float | None) -> None:
    trainer = Trainer(CONFIG, adamw(1e-3), "1f1b", microbatches=4, dtype=dtype,
                      clip_grad=clip)
    trainer.step(_batch(0))  # the first step builds the optimizer's state
    reads = _reads(trainer, _batch(1))
    assert reads == ["tolist"], reads
    assert trainer.last_update is not None and not trainer.last_update.skipped


def test_nonfinite_step_is_skipped_with_the_same_one_sync() -> None:
    """The skip is decided on the norm read with the loss: nothing updated, and the
    step still reads the device once."""
    trainer = Trainer(CONFIG, adamw(1e-3), "1f1b", microbatches=4, dtype=torch.bfloat16)
    trainer.step(_batch(0))
    before = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    masters = [p.detach().clone() for p in trainer.parts.precision.params]
    fold = trainer.parts.precision.fold

    def poisoned(indices: Any = None) -> None:
        fold(indices)
        trainer.parts.precision.grads()[0].view(-1)[0] = float("nan")

    trainer.parts.precision.fold = poisoned  # type: ignore[method-assign]
    reads = _reads(trainer, _batch(1))
    trainer.parts.precision.fold = fold  # type: ignore[method-assign]
    assert reads == ["tolist"], reads
    u = trainer.last_update
    assert u is not None and u.skipped and u.grad_norm != u.grad_norm  # NaN
    assert all(torch.equal(before[n], p) for n, p in trainer.named_parameters())
    assert all(torch.equal(a, b) for a, b in zip(masters, trainer.parts.precision.params,
                                                 strict=True))
    trainer.step(_batch(2))
    assert trainer.last_update is not None and not trainer.last_update.skipped
