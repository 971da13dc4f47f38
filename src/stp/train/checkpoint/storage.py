"""Storage faults while writing or reading a sharded checkpoint, told as one line.

torch.distributed.checkpoint reports a failed write or read as a
`CheckpointException`, which derives from BaseException (not Exception): a
handler for ValueError / RuntimeError lets it through, and its text is every
rank's traceback. A full disk then showed as a 25-173-line traceback that
named no file and left the `.partial` on the full disk. Here:

* `space_check(root, state)` (collective, before a save): the checkpoint's
  size summed over the ranks against the free space of the device holding
  `root`; `check_free_space` does the same before training starts, from the
  model's size (`checkpoint_bytes`). A disk that cannot hold one more
  checkpoint is refused before any byte is written.
* `save_failure(exc, tmp, final)`: the line for a failed save: the checkpoint,
  the cause in words ("no space left on device", from the OSError's errno),
  the `.partial` removed (by global rank 0), and the newest earlier complete
  checkpoint, which the failed save never touched.
* `load_failure(exc, path)`: the same for a failed read.

Both raise `StorageFault`, a ValueError: stp's CLI prints it as one line and
exits 2, like every refusal of input it cannot use.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["StorageFault", "cause_of", "checkpoint_bytes", "check_free_space", "load_failure",
           "save_failure", "space_check"]

MARGIN = 1.1
"""Free space wanted per byte of checkpoint (index, stp.json, filesystem blocks)."""


class StorageFault(ValueError):
    """A checkpoint could not be written or read because of the storage."""

    agreed = True
    """Raised alike on every rank (a collective verdict): rank 0 alone reports it."""


def cause_of(exc: BaseException) -> str:
    """The root cause in words: a CheckpointException's first rank failure, an OSError's
    errno as the C library says it (lower case: "no space left on device")."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            first = failures[min(failures)]
            exc = first[0] if isinstance(first, tuple) else first
            continue
        inner = exc.__cause__ or exc.__context__
        if not isinstance(exc, OSError) and inner is not None:
            exc = inner
            continue
        break
    if isinstance(exc, OSError) and exc.errno is not None:
        text = os.strerror(exc.errno).lower()
        return f"{text} ({errno.errorcode.get(exc.errno, exc.errno)})"
    line = " ".join(str(exc).split())[:160]
    if "weights_only" in line:  # torch's unpickler advice: the bytes are not a tensor
        return "its data is damaged (not a tensor torch reads)"
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _earlier(final: Path) -> str:
    from stp.train.checkpoint.integrity import complete_steps

    older = [p for p in complete_steps(final.parent) if p.name != final.name]
    if not older:
        return "no earlier checkpoint is in that directory"
    return f"the earlier checkpoint {older[-1]} is intact"


def _short_write(cause: str, where: Path) -> str:
    """A write torch's zip writer found short ("unexpected pos 704 vs 598": the bytes
    stopped landing, no errno reached it) named by what stops writes: a file-size limit
    (`ulimit -f`), or a full device."""
    if "unexpected pos" not in cause:
        return cause
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (f"file too large (EFBIG): the process's file-size limit (ulimit -f) is "
                f"{_mib(limit)}")
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if shutil.disk_usage(probe).free < 2**20:
        return "no space left on device (ENOSPC)"
    return f"a write came up short ({cause})"


def save_failure(exc: BaseException, tmp: Path, final: Path, rank: int) -> StorageFault:
    """The one-line StorageFault for a save of `final` (written into `tmp`) that failed
    with `exc`; global rank 0 removes `tmp` (every rank gets here once DCP gathered the
    failures, so no rank still writes into it)."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    cause = _short_write(cause_of(exc), final.parent)
    return StorageFault(f"cannot write checkpoint {final}: {cause}; the partial "
                        f"{tmp.name} was removed; {_earlier(final)}")


def load_failure(exc: BaseException, path: Path) -> StorageFault:
    return StorageFault(f"cannot read checkpoint {path}: {cause_of(exc)}")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _space_problem(root: Path, need: int, what: str) -> str | None:
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return None  # no statistics (some network filesystems): the write will tell
    if free < need * MARGIN:
        return (f"{what} {root} needs about {_mib(need * MARGIN)} for a checkpoint, "
                f"{_mib(free)} is free on its device: free space or give another --out")
    return None


def space_check(root: Path, state: dict[str, Any], rank: int) -> None:
    """Collective before a save: StorageFault on every rank when the device holding
    `root` cannot take the checkpoint (every rank's tensors summed)."""
    import torch
    import torch.distributed as dist

    mine = sum(v.numel() * v.element_size() for v in state.values()
               if isinstance(v, torch.Tensor))
    sizes: list[Any] = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, mine)
    box = [_space_problem(root, sum(sizes), "checkpoint directory") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise StorageFault(box[0])


def checkpoint_bytes(params: int, dtype: str) -> int:
    """About the bytes of one sharded checkpoint of a model of `params` parameters (its
    family's `parameter_count`): the weights in `dtype`, fp32 masters with bfloat16,
    AdamW's two moments in the optimizer's dtype."""
    width = {"float64": 8, "float32": 4, "bfloat16": 2}.get(dtype, 4)
    master = 4 if dtype == "bfloat16" else width
    return params * (width + (master if dtype == "bfloat16" else 0) + 2 * master)


def check_free_space(out: str | os.PathLike[str] | None, need: int) -> None:
    """ValueError before training when --out's device cannot hold one checkpoint."""
    if out is None or need <= 0:
        return
    problem = _space_problem(Path(out), need, "--out")
    if problem is not None:
        raise StorageFault(problem)
