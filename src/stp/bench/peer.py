"""stp's runtime against PyTorch's own: `torch.distributed.pipelining`, side by side.

Both sides train the same decoder (same layers per stage, same initial values,
stp.models.init), on the same batch, dtype, microbatches and schedule, on pp
ranks with tp=1 (PyTorch's pipelining runs no TP by itself):

* stp: `Trainer.step`, the executor running stp's lowered schedule;
* torch: `PipelineStage`s over `DecoderPart`, a plain-autograd module holding
  the same layers as stp's stage, driven by PyTorch's schedule class of the
  same name (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
  ScheduleGPipe), and, as "torch-csv", by `_PipelineScheduleRuntime` loading
  stp's exported compute-only CSV: the exact same order on both runtimes.

A step on either side is the same work: zero the gradients, run the m
microbatches (weight gradients are the mean over microbatches: stp seeds each
backward with 1/m, PyTorch divides by m at the end), all-reduce the mean loss
over the world so every rank returns it, the global gradient norm (stp's
Trainer computes it every step, to skip a non-finite step), one optimizer step.
The PyTorch side lives in stp.bench.peer_torch. Steps alternate
inside one process group (stp, torch, torch-csv, stp, ...), so the drift of a
shared machine hits every side; each round gives one ratio stp / torch.
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import pstats
import re
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.bench.peer_torch import (
    TORCH_CLASSES,
    DecoderPart,
    TorchSide,
    build_torch_stages,
    lm_loss,
    torch_schedule,
)
from stp.models import ModelConfig
from stp.schedule import registry
from stp.train.trainer import Trainer

__all__ = ["PeerSpec", "DecoderPart", "lm_loss", "build_torch_stages", "torch_schedule",
           "TorchSide", "peer_worker", "peer_entry", "run_peer", "format_table", "TORCH_CLASSES"]


@dataclass(frozen=True)
class PeerSpec:
    """One side-by-side measurement (see the module doc)."""

    schedules: tuple[str, ...] = ("1f1b", "1f1b-interleaved", "zb-v")
    """stp schedule names; each must be in TORCH_CLASSES (csv=True runs it by CSV too)."""
    pp: int = 2
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    seq_len: int = 128
    microbatch_size: int = 4
    microbatches: int = 8
    dtype: str = "float32"
    pairs: int = 7
    """Timed rounds; each runs one step of every side."""
    warmup: int = 2
    """Untimed rounds first (PyTorch infers shapes on its first step)."""
    csv: bool = True
    """Also run stp's exported CSV through `_PipelineScheduleRuntime`."""
    memory: bool = True
    """Measure each side's peak resident growth in one step (Linux only)."""
    profile_rank: int | None = None
    """Global rank whose steps are also run under cProfile (`pairs` more rounds, untimed)."""
    lr: float = 1e-3
    timeout: float = 300.0

    def __post_init__(self) -> None:
        bad = [s for s in self.schedules if s not in TORCH_CLASSES]
        if bad or not self.schedules:
            raise ValueError(f"schedules {list(self.schedules)!r} not accepted; each must have "
                             f"a PyTorch class: {', '.join(TORCH_CLASSES)}")
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"dtype {self.dtype!r} not accepted; use float32, float64 or bfloat16")
        if self.pairs < 1 or self.warmup < 1:
            raise ValueError(f"pairs and warmup must be >= 1, got {self.pairs}, {self.warmup}")
        if self.profile_rank is not None and not 0 <= self.profile_rank < self.pp:
            raise ValueError(f"profile_rank must be in [0, pp={self.pp}), got {self.profile_rank}")

    def model(self) -> ModelConfig:
        return ModelConfig(hidden=self.hidden, num_layers=self.layers, num_heads=self.heads,
                           num_kv_heads=self.kv_heads, max_seq_len=self.seq_len)


# -- measuring ------------------------------------------------------------------


def _span(fn: Callable[[], Any]) -> tuple[float, list[tuple[float, int]]]:
    """(seconds from the earliest start to the latest end of fn over the world, each
    rank's (CPU seconds, minor page faults) in it). CPU time counts the work a rank
    does (its gloo threads too, not its blocking waits), so it moves far less than
    wall time when other jobs share the cores."""
    dist.barrier()
    start, cpu, faults = time.perf_counter(), time.process_time(), _faults()
    fn()
    spans = _gather((start, time.perf_counter(), time.process_time() - cpu, _faults() - faults))
    wall = max(s[1] for s in spans) - min(s[0] for s in spans)
    return wall, [(s[2], s[3]) for s in spans]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE)[1])  # type: ignore[index]


def _peak_growth_mib(fn: Callable[[], Any]) -> float | None:
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


def _profile(fn: Callable[[], Any], rounds: int, on: bool, top: int = 25) -> str | None:
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


Sides = dict[str, Callable[[], float]]


def _sides(spec: PeerSpec, name: str) -> Sides:
    """One step of each side of schedule `name` on this rank, as callables."""
    config, dtype = spec.model(), getattr(torch, spec.dtype)
    schedule = registry.make(name, spec.pp, spec.microbatches)

    def optimizer(ps: list[nn.Parameter]) -> Any:
        return torch.optim.SGD(ps, lr=spec.lr)

    trainer = Trainer(config, optimizer, schedule, pp=spec.pp, dtype=dtype,
                      timeout=spec.timeout)
    rows = schedule.num_microbatches * spec.microbatch_size
    ids = torch.randint(0, config.vocab_size, (rows, spec.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    tokens, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    sides: Sides = {"stp": lambda: trainer.step((tokens, targets))}
    variants = [("torch", False)] + ([("torch-csv", True)] if spec.csv else [])
    for label, from_csv in variants:
        side = TorchSide(name, schedule, dist.get_rank(), config, dtype, optimizer,
                         from_csv=from_csv)
        sides[label] = lambda side=side: side.step(tokens, targets)
    return sides


def _time(spec: PeerSpec, name: str, sides: Sides) -> dict[str, Any]:
    """Rounds of one step of every side in turn: wall times, ratios, CPU and faults."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[list[tuple[float, int]]]] = {k: [] for k in sides}
    for r in range(spec.warmup + spec.pairs):
        for label, fn in sides.items():
            wall, per_rank = _span(fn)
            if r >= spec.warmup:
                times[label].append(wall)
                cpu[label].append(per_rank)
    row: dict[str, Any] = {"schedule": name, "times": times, "cpu": cpu}
    for label in sides:
        if label != "stp":
            row[f"ratio_{label}"] = [a / b for a, b in zip(times["stp"], times[label],
                                                           strict=True)]
    return row


def peer_worker(spec: PeerSpec) -> dict[str, Any] | None:
    """Run every schedule of `spec` on this rank (world = spec.pp ranks, gloo); the
    figures on global rank 0 (and the profile text, if asked, on profile_rank)."""
    if dist.get_world_size() != spec.pp:
        raise ValueError(f"the peer benchmark runs on pp={spec.pp} ranks, "
                         f"the world has {dist.get_world_size()}")
    rank = dist.get_rank()
    sides = {name: _sides(spec, name) for name in spec.schedules}
    rows = [_time(spec, name, sides[name]) for name in spec.schedules]
    for row in rows:
        if spec.profile_rank is not None:
            row["profile"] = {label: _profile(fn, spec.pairs, rank == spec.profile_rank)
                              for label, fn in sides[row["schedule"]].items()}
    for row in rows:  # last: it fixes glibc's mmap threshold for the rest of the process
        if spec.memory:
            row["peak_mib"] = {label: _gather(_peak_growth_mib(fn))
                               for label, fn in sides[row["schedule"]].items()}
    if rank == 0 or rank == spec.profile_rank:
        return {"spec": spec, "rows": rows, "rank": rank}
    return None


def peer_entry(spec: PeerSpec) -> dict[str, Any] | None:
    """A launched worker (module level, spawned by name; stp.runtime.launch.launch_local)."""
    from stp.runtime.launch import init_distributed

    init_distributed(timeout=spec.timeout)
    try:
        return peer_worker(spec)
    finally:
        dist.destroy_process_group()


def run_peer(spec: PeerSpec) -> dict[str, Any]:
    """Start spec.pp local gloo workers (stp.runtime.launch.launch_local), measure, and
    return {"spec", "rows": the figures (`format_table` prints them), "profiles":
    {schedule: {side: cProfile text}} when spec.profile_rank is set}. RuntimeError
    when a worker fails (its error is printed by the worker)."""
    from stp.runtime.launch import launch_local

    result = launch_local(peer_entry, (spec,), spec.pp)
    if result.exitcode:
        raise RuntimeError(f"peer benchmark failed on ranks {result.failed_ranks} "
                           f"(exit status {result.exitcode})")
    out: dict[str, Any] = {"spec": spec, "rows": result.returns[0]["rows"], "profiles": {}}
    if spec.profile_rank is not None:
        for row in result.returns[spec.profile_rank]["rows"]:
            out["profiles"][row["schedule"]] = row.pop("profile")
    for row in out["rows"]:
        row.pop("profile", None)
    return out


def format_table(result: dict[str, Any]) -> str:
    """The figures of one run as Markdown: per schedule, each side's median step time
    (ms, slowest rank) and stp / side min / median / max over rounds; then per side
    and rank the median CPU ms and page faults per step and the peak resident
    growth in a step (MiB)."""
    spec: PeerSpec = result["spec"]
    rows = result["rows"]
    others = [k for k in rows[0]["times"] if k != "stp"]
    lines = [f"pp={spec.pp} tp=1, {spec.layers} layers, hidden {spec.hidden}, seq "
             f"{spec.seq_len}, microbatch size {spec.microbatch_size}, m={spec.microbatches}, "
             f"{spec.dtype}, {spec.pairs} rounds", "",
             "| schedule | stp ms | " + " | ".join(f"{k} ms | stp/{k} min / med / max"
                                                   for k in others) + " |",
             "|---" * (2 + 2 * len(others)) + "|"]
    for row in rows:
        med = {k: f"{1e3 * statistics.median(v):.1f}" for k, v in row["times"].items()}
        ratios = [f"{med[k]} | {_spread(row[f'ratio_{k}'])}" for k in others]
        lines.append(f"| {row['schedule']} | {med['stp']} | " + " | ".join(ratios) + " |")
    lines += ["", "| schedule | side | CPU ms per rank | CPU stp/side per rank "
              "| page faults per rank | peak MiB per rank |", "|---|---|---|---|---|---|"]
    for row in rows:
        cpu = {k: _per_rank(v, 0) for k, v in row["cpu"].items()}
        for side in row["cpu"]:
            ratio = "-" if side == "stp" else _join(
                (a / b for a, b in zip(cpu["stp"], cpu[side], strict=True)), "{:.2f}")
            peaks = (row.get("peak_mib") or {}).get(side) or []
            lines.append(f"| {row['schedule']} | {side} | {_join(1e3 * c for c in cpu[side])} "
                         f"| {ratio} | {_join(_per_rank(row['cpu'][side], 1))} | "
                         f"{', '.join('?' if v is None else f'{v:.0f}' for v in peaks) or '-'} |")
    return "\n".join(lines)


def _per_rank(rounds: list[list[tuple[float, int]]], field: int) -> list[float]:
    return [statistics.median(r[k][field] for r in rounds) for k in range(len(rounds[0]))]


def _join(values: Any, fmt: str = "{:.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"
