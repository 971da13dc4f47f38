"""A process measured while it runs a function: the world's wall span with each
rank's CPU time and page faults, the peak resident growth, a cProfile. Linux
figures (/proc, glibc) where the standard library has none."""

from __future__ import annotations

import cProfile
import ctypes
import io
import pstats
import re
import resource
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["span", "gather", "peak_growth_mib", "profile"]


def span(fn: Callable[[], Any]) -> tuple[float, list[tuple[float, int]]]:
    """(seconds from the earliest start to the latest end of fn over the world, each
    rank's (CPU seconds, minor page faults) in it). CPU time counts the work a rank
    does (its gloo threads too, not its blocking waits), so it moves far less than
    wall time when other jobs share the cores."""
    dist.barrier()
    start, cpu, faults = time.perf_counter(), time.process_time(), _faults()
    fn()
    spans = gather((start, time.perf_counter(), time.process_time() - cpu, _faults() - faults))
    wall = max(s[1] for s in spans) - min(s[0] for s in spans)
    return wall, [(s[2], s[3]) for s in spans]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gather(value: Any) -> list[Any]:
    """`value` of every rank of the world, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(found[1])


def peak_growth_mib(fn: Callable[[], Any]) -> float | None:
    """Peak resident memory of this process above its level at the start of fn, MiB.
    glibc is told to map every block over 64 KiB on its own and to return freed
    memory first, so resident memory follows live tensors; the peak counter is
    reset through /proc/self/clear_refs. None where that is not possible. The
    threshold stays fixed for the rest of the process: measure memory last."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD, fixed (no dynamic raise)
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        base = _rss_kib("VmRSS")
    except OSError:
        return None
    fn()
    return (_rss_kib("VmHWM") - base) / 1024


def profile(fn: Callable[[], Any], rounds: int, on: bool, top: int = 25) -> str | None:
    """cProfile's top entries by own time over `rounds` calls of fn (every rank calls
    fn as often; only the one with `on` profiles)."""
    if not on:
        for _ in range(rounds):
            fn()
        return None
    prof = cProfile.Profile()
    for _ in range(rounds):
        prof.runcall(fn)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
