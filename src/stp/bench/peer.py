"""stp's runtime against PyTorch's own: `torch.distributed.pipelining`, side by side.

Both sides train the same decoder (same layers per stage, same initial values,
stp.models.decoder.init), on the same batch, dtype, microbatches and schedule, on pp
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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.bench.peer_torch import TORCH_CLASSES, TorchSide
from stp.bench.probes import gather, peak_growth_mib, profile, span
from stp.bench.world import in_world
from stp.models import ModelConfig
from stp.schedule import registry
from stp.train.trainer import Trainer

__all__ = ["PeerSpec", "peer_worker", "peer_entry", "run_peer"]


@dataclass(frozen=True)
class PeerSpec:
    """One side-by-side measurement (see the module doc)."""

    schedules: tuple[str, ...] = ("1f1b", "1f1b-interleaved", "zb-v")
    """stp schedule names; each must be in TORCH_CLASSES (csv=True runs it by CSV too)."""
    pp: int = 2
    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        hidden=256, num_layers=8, num_heads=4, num_kv_heads=4, max_seq_len=128))
    """The model both sides train (stp's decoder; torch's side builds the same one)."""
    seq_len: int = 128
    """Tokens per sequence (at most the model's max_seq_len)."""
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
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's max_seq_len "
                             f"{self.model.max_seq_len}")
        if self.profile_rank is not None and not 0 <= self.profile_rank < self.pp:
            raise ValueError(f"profile_rank must be in [0, pp={self.pp}), got {self.profile_rank}")

Sides = dict[str, Callable[[], float]]


def _sides(spec: PeerSpec, name: str) -> Sides:
    """One step of each side of schedule `name` on this rank, as callables."""
    config, dtype = spec.model, getattr(torch, spec.dtype)
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
            wall, per_rank = span(fn)
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
            row["profile"] = {label: profile(fn, spec.pairs, rank == spec.profile_rank)
                              for label, fn in sides[row["schedule"]].items()}
    for row in rows:  # last: it fixes glibc's mmap threshold for the rest of the process
        if spec.memory:
            row["peak_mib"] = {label: gather(peak_growth_mib(fn))
                               for label, fn in sides[row["schedule"]].items()}
    if rank == 0 or rank == spec.profile_rank:
        return {"spec": spec, "rows": rows, "rank": rank}
    return None


def peer_entry(spec: PeerSpec) -> dict[str, Any] | None:
    """A launched worker (module level, spawned by name; stp.runtime.launch.launch_local)."""
    return in_world(peer_worker, spec, spec.timeout)


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


