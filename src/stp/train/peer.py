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
over the world so every rank returns it, one optimizer step. Steps alternate
inside one process group (stp, torch, torch-csv, stp, ...), so the drift of a
shared machine hits every side; each round gives one ratio stp / torch.
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import os
import pstats
import re
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from stp.models import ModelConfig
from stp.models.init import init_full, parameter_specs
from stp.models.rope import RopeCache, apply_rope
from stp.schedule import Schedule, registry
from stp.schedule import io as schedule_io
from stp.schedule.placement import stage_layers
from stp.train.trainer import Trainer

__all__ = ["PeerSpec", "DecoderPart", "lm_loss", "build_torch_stages", "torch_schedule",
           "TorchSide", "peer_worker", "peer_entry", "run_peer", "format_table", "TORCH_CLASSES"]

TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "1f1b-interleaved": "ScheduleInterleaved1F1B",
    "zb-v": "ScheduleZBVZeroBubble",
}
"""stp schedule name -> PyTorch's class running the same order (pp=2: identical lists)."""


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as a user writes it, statistics in at least float32 (as stp's)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class DecoderPart(nn.Module):
    """Layers `layers` of the decoder as plain autograd code, parameters under the global
    names and with the initial values of stp's stage (stp.models.init). The same kernels
    as stp's units (F.linear, SDPA with enable_gqa, RoPE tables of stp.models.decoder),
    so both sides do the same FLOPs. first: token ids [b, s] in (embedding); last:
    logits [b, s, V] out (norm and head); else hidden states [b, s, h] in and out."""

    def __init__(self, config: ModelConfig, layers: range, *, first: bool, last: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        extras = [k for k in ("qkv_bias", "tie_embeddings", "pad_token_id")
                  if getattr(config, k) not in (None, False)]
        if extras:
            raise ValueError(f"DecoderPart runs the plain decoder; {', '.join(extras)} "
                             "not accepted (leave them at their defaults)")
        self.config, self.layer_ids, self.first, self.last = config, layers, first, last
        self.p: dict[str, nn.Parameter] = {}
        for spec in parameter_specs(config, layers, first=first, last=last):
            param = nn.Parameter(init_full(config, spec, dtype))
            *path, leaf = spec.name.split(".")
            module: nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]  # type: ignore[assignment]
            module.register_parameter(leaf, param)
            self.p[spec.name] = param
        self.rope = RopeCache(config.head_dim, config.rope_theta, config.rope_scaling)

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p, hd = self.p, self.config.head_dim
        b, s, _ = h.shape
        q = F.linear(h, p[f"layers.{i}.attn.wq.weight"]).view(b, s, -1, hd).transpose(1, 2)
        k = F.linear(h, p[f"layers.{i}.attn.wk.weight"]).view(b, s, -1, hd).transpose(1, 2)
        v = F.linear(h, p[f"layers.{i}.attn.wv.weight"]).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = self.rope.get(s, h.device, h.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), p[f"layers.{i}.attn.wo.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = self.p
        gate = F.silu(F.linear(h, p[f"layers.{i}.mlp.w1.weight"]))
        return F.linear(gate * F.linear(h, p[f"layers.{i}.mlp.w3.weight"]),
                        p[f"layers.{i}.mlp.w2.weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, eps = self.p, self.config.norm_eps
        if self.first:
            x = F.embedding(x, p["embed.weight"])  # [b, s] -> [b, s, h]
        for i in self.layer_ids:
            x = x + self._attention(i, _rms_norm(x, p[f"layers.{i}.attn_norm.weight"], eps))
            x = x + self._mlp(i, _rms_norm(x, p[f"layers.{i}.mlp_norm.weight"], eps))
        if self.last:
            x = F.linear(_rms_norm(x, p["norm.weight"], eps), p["head.weight"])  # [b, s, V]
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the microbatch's tokens (stp's loss unit computes the same)."""
    flat = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(flat, targets.flatten())


def build_torch_stages(config: ModelConfig, schedule: Schedule, pp_rank: int,
                       dtype: torch.dtype) -> list[PipelineStage]:
    """PyTorch PipelineStages of pipeline rank pp_rank, one per stage stp places there
    (schedule.stages_of), each holding the layers stp's stage of that index holds."""
    n = schedule.num_stages
    stages = []
    for s in schedule.stages_of(pp_rank):
        part = DecoderPart(config, stage_layers(config.num_layers, s, n),
                           first=s == 0, last=s == n - 1, dtype=dtype)
        stages.append(PipelineStage(part, s, n, torch.device("cpu")))
    return stages


def torch_schedule(name: str, schedule: Schedule, stages: list[PipelineStage],
                   *, from_csv: bool = False) -> Any:
    """PyTorch's schedule class for stp schedule `name` over `stages`, or (from_csv)
    `_PipelineScheduleRuntime` running stp's exported compute-only CSV of `schedule`."""
    m = schedule.num_microbatches
    if from_csv:
        runtime = torch_schedules._PipelineScheduleRuntime(stages, m, loss_fn=lm_loss)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "schedule.csv")
            with open(path, "w") as f:
                f.write(schedule_io.dump_csv(schedule))
            runtime._load_csv(path)
        return runtime
    if name not in TORCH_CLASSES:
        raise ValueError(f"no PyTorch schedule for {name!r}; choose one of: "
                         f"{', '.join(TORCH_CLASSES)} (or from_csv=True)")
    cls = getattr(torch_schedules, TORCH_CLASSES[name])
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, m, loss_fn=lm_loss)


class TorchSide:
    """One rank's PyTorch pipeline; `step` does the work `Trainer.step` does."""

    def __init__(self, name: str, schedule: Schedule, pp_rank: int, config: ModelConfig,
                 dtype: torch.dtype, optimizer: Callable[[list[nn.Parameter]], Any],
                 *, from_csv: bool = False) -> None:
        self.stages = build_torch_stages(config, schedule, pp_rank, dtype)
        self.schedule = torch_schedule(name, schedule, self.stages, from_csv=from_csv)
        mine = schedule.stages_of(pp_rank)
        self.first, self.last = 0 in mine, schedule.num_stages - 1 in mine
        self.m = schedule.num_microbatches
        self.parameters = [p for st in self.stages for p in st.submod.parameters()]
        self.optimizer = optimizer(self.parameters)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [kv for st in self.stages for kv in st.submod.named_parameters()]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One iteration on the batch [m * b, s]; the mean loss, the same on every rank."""
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        total = torch.zeros((), dtype=torch.float64)
        if self.last:
            total += sum(float(v.detach()) for v in losses) / self.m
        dist.all_reduce(total)
        self.optimizer.step()
        return float(total)


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
