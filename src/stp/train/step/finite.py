"""No run that trains nothing: non-finite weights refused, endless skipped steps stopped.

NaN or inf weights (from a checkpoint or a Hugging Face directory) made every
step's gradients non-finite, so every update was skipped (stp.train.step.precision),
the run printed `loss nan -> nan` and exited 0, and its NaN checkpoints pushed
the good ones out under --keep. Now:

* weights are checked before training: `scan_dcp` (the model, master and
  optimizer-state tensors of a sharded checkpoint, one chunk at a time, through the weights-only
  reader) and `scan_hf` (every tensor of a Hugging Face directory, a block at a time)
  run before any worker starts; `require_finite` (collective) after a checkpoint
  is loaded into a Trainer, for the library's own Trainer.resume. One line naming
  the tensor.
* `require_finite` before a save: a non-finite model is never written, so it can
  never rotate a good checkpoint out.
* `SkipCounter`: `--max-skipped-steps` consecutive skipped updates stop the run
  with a non-zero exit naming the steps (every rank decides alike: the skip is
  decided on the global gradient norm).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["NonFinite", "SkipCounter", "TooManySkipped", "first_nonfinite", "require_finite",
           "scan_dcp", "scan_hf"]


class NonFinite(ValueError):
    """A weight holds NaN or inf."""

    agreed = True
    """Raised alike on every rank (a collective verdict): rank 0 alone reports it."""


class TooManySkipped(ValueError):
    """Too many consecutive steps had non-finite gradients."""


def _bad(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).all())


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding NaN or inf, else None."""
    for name, t in named:
        if _bad(t.detach()):
            return name
    return None


def require_finite(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Collective: NonFinite on every rank when any rank's tensors hold NaN or inf
    (`what` ends the line: what is refused). One rank's verdict is every rank's, so
    no rank goes on into a collective the others left."""
    import torch.distributed as dist

    mine = first_nonfinite(named)
    if dist.is_initialized() and dist.get_world_size() > 1:
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        mine = next((f for f in found if f is not None), None)
    if mine is not None:
        raise NonFinite(f"weight {mine} holds NaN or inf: {what}")


def scan_dcp(path: str | os.PathLike[str]) -> None:
    """NonFinite naming the first model, master or optimizer-state tensor of sharded
    checkpoint `path` that holds NaN or inf, with the shard file it lies in (read chunk
    by chunk with the weights-only reader: memory is one chunk). AdamW's moments are
    checked as the weights are: NaN there poisons the first update, and was found only
    when the run refused to save after training. The checkpoint's files were verified
    before (stp.train.checkpoint.integrity)."""
    from stp.train.checkpoint.read import read_metadata

    root = Path(path)
    md = read_metadata(root)
    for index, info in md.storage_data.items():
        if not index.fqn.startswith(("model/", "master/", "optim/")):
            continue
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - damage the checksums did not cover (no manifest)
            raise NonFinite(f"checkpoint {root}: tensor {index.fqn} cannot be read from "
                            f"{info.relative_path} (damaged)") from None
        if isinstance(t, torch.Tensor) and _bad(t):
            kind, name = index.fqn.split("/", 1)
            what = "optimizer state" if kind == "optim" else "weight"
            raise NonFinite(f"checkpoint {root}: {what} {name} holds NaN or inf (in "
                            f"{info.relative_path}): resuming would train nothing; resume from "
                            "an earlier step")


def scan_hf(ckpt: Any) -> None:
    """NonFinite naming the first tensor of Hugging Face checkpoint `ckpt` (an
    HFCheckpoint) that holds NaN or inf; read in blocks of about a megabyte, never a
    whole tensor in memory."""
    from stp.models.hf.slices import NotFinite, scan_finite

    for _, key in sorted((t.file, key) for key, t in ckpt.stored.items()):
        try:
            scan_finite(ckpt.stored[key])
        except NotFinite as e:
            raise NonFinite(str(e)) from None


class SkipCounter:
    """Counts consecutive skipped updates; TooManySkipped at `limit` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.run, self.first = limit, 0, 0

    def update(self, skipped: bool, step: int) -> None:
        """After step `step` (1-based) with `skipped` (the same on every rank)."""
        if not skipped:
            self.run = 0
            return
        self.run += 1
        self.first = step if self.run == 1 else self.first
        if self.limit and self.run >= self.limit:
            raise TooManySkipped(
                f"{self.run} consecutive steps ({self.first}-{step}) had inf/NaN gradients and "
                "updated nothing: training stopped (the checkpoints written before are "
                "finite); lower --lr, set --clip-grad, or raise --max-skipped-steps")
