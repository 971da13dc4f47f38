"""One run per output directory: a lock on --out for the whole run.

Two runs saving into one directory corrupted each other: a published
`step-N` held one run's weights with the other's stp.json, or no `.metadata`,
and each run's save removes a `.partial` it finds (left by a killed run) which
may be the other's checkpoint being written. So a run holds an exclusive
`fcntl.flock` on `--out/.stp-lock` from before training until the process
ends (the kernel drops it when the process dies, even on SIGKILL: no stale
lock to clean up), and writes its process id into the file so the refused run
can name the holder. While a run holds the lock no other stp run writes into
that directory, which is why a `.partial` found there is a killed run's and
safe to remove (stp.train.checkpoint.sharded.save).

Who takes it: `stp train`'s own process (the local launcher, or the single
process) before any worker starts; under torchrun, global rank 0 once the
ranks meet (stp.train.run.loop). flock works across processes of one machine and,
on Linux NFS clients, through the server's lock manager; other shared
filesystems may not honour it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from stp.train.run.config import TrainJob

__all__ = ["LOCK_FILE", "OutInUse", "existing_out", "hold_out", "lock_error", "release_all"]

LOCK_FILE = ".stp-lock"
_held: dict[str, int] = {}
"""Resolved directory -> the open descriptor holding its lock (for the process's life)."""


class OutInUse(ValueError):
    """Another live process holds the lock on the directory."""


def hold_out(directory: str | os.PathLike[str], flag: str = "--out") -> None:
    """Lock `directory` (created if needed) for this process until it exits; OutInUse
    naming the holder's process id when another process holds it. Idempotent."""
    root = Path(directory)
    key = str(root.resolve())
    if key in _held:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ValueError(f"{flag} {str(directory)!r} is not a writable directory: "
                         f"{e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise OutInUse(
            f"{flag} {str(directory)!r} is in use by another stp run (process {holder}): "
            "two runs writing one directory corrupt each other's checkpoints; wait for it "
            f"to end or give another {flag}") from None
    except OSError as e:
        os.close(fd)
        raise ValueError(f"{flag} {str(directory)!r}: cannot lock it: {e.strerror or e}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd


def existing_out(job: TrainJob) -> str | None:
    """The directory `job` will write that exists already: --out, or without it the run
    directory of the checkpoint --resume continues; None for a new one (or no
    checkpoint to resume: the checks say so)."""
    if job.out is not None:
        return job.out if os.path.isdir(job.out) else None
    if job.resume is None:
        return None
    from stp.train.checkpoint.resume import run_dir_of
    from stp.train.checkpoint.sharded import latest

    try:
        return str(run_dir_of(latest(job.resume)))
    except ValueError:
        return None


def lock_error(directory: str | os.PathLike[str]) -> str | None:
    """`hold_out`'s refusal as a line (to broadcast to the other ranks), or None. A
    worker of stp's own launcher takes no lock: the launcher holds it."""
    from stp.runtime.watch import LAUNCHER_PID_ENV

    if os.environ.get(LAUNCHER_PID_ENV):
        return None
    try:
        hold_out(directory)
    except ValueError as e:
        return str(e)
    return None


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


def release_all() -> None:
    """Drop every lock this process holds (tests; a process's exit drops them too)."""
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
