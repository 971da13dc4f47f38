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

At tp > 1 (pp x tp ranks, tp fastest) or compiled, the torch side is built the
torchtitan way (stp.bench.peer_tp): DTensor tensor parallelism per block on a
pp x tp DeviceMesh, blocks compiled one by one with `compile`, PyTorch's
schedule on top. stp's side gets `compile=True` in its Trainer options when
the build has that option. A side that cannot run (PyTorch refuses ZB-V with
compiled blocks; a build without stp's compile) is reported with its reason
instead of figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.bench.peer_torch import TORCH_CLASSES, TorchSide
from stp.bench.probes import gather, peak_growth_mib, profile, span
from stp.bench.world import in_world
from stp.models import ModelConfig
from stp.schedule import registry
from stp.train.step.trainer import Trainer

__all__ = ["PeerSpec", "peer_worker", "peer_entry", "run_peer"]


@dataclass(frozen=True)
class PeerSpec:
    """One side-by-side measurement (see the module doc)."""

    schedules: tuple[str, ...] = ("1f1b", "1f1b-interleaved", "zb-v")
    """stp schedule names; each must be in TORCH_CLASSES (csv=True runs it by CSV too)."""
    pp: int = 2
    tp: int = 1
    """TP ranks per stage; the world is pp x tp ranks (tp fastest)."""
    compile: bool = False
    """Both sides compiled: torch per block (torchtitan's way), stp with its Trainer's
    compile option."""
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
        if self.tp < 1 or self.model.num_heads % self.tp or self.model.num_kv_heads % self.tp:
            raise ValueError(f"tp {self.tp} not accepted; it must divide the model's heads "
                             f"({self.model.num_heads}) and kv heads ({self.model.num_kv_heads})")
        if self.profile_rank is not None and not 0 <= self.profile_rank < self.world:
            raise ValueError(f"profile_rank must be in [0, pp x tp = {self.world}), "
                             f"got {self.profile_rank}")

    @property
    def world(self) -> int:
        return self.pp * self.tp

    @property
    def label(self) -> str:
        """The table's setting: `tp1 eager`, `tp2 compiled`, ..."""
        return f"tp{self.tp} {'compiled' if self.compile else 'eager'}"

Sides = dict[str, Callable[[], float]]

STP_COMPILE_MISSING = "stp --compile not available in this build"
CSV_COMPILED = ("compiled, `_PipelineScheduleRuntime` skips the compile check of torch's "
                "split-backward classes, and a compiled block's backward input then "
                "fails on donated buffers (pytorch issue #161904)")


def stp_has_compile() -> bool:
    """Whether this build's Trainer options have `compile` (added by the compile work)."""
    from stp.train.run.parts import TrainerOptions

    return "compile" in {f.name for f in fields(TrainerOptions)}


def _sides(spec: PeerSpec, name: str) -> tuple[Sides, dict[str, str]]:
    """One step of each side of schedule `name` on this rank, as callables, and the
    sides that cannot run with the reason (the same on every rank)."""
    config, dtype = spec.model, getattr(torch, spec.dtype)
    schedule = registry.make(name, spec.pp, spec.microbatches)

    def optimizer(ps: list[nn.Parameter]) -> Any:
        return torch.optim.SGD(ps, lr=spec.lr)

    rows = schedule.num_microbatches * spec.microbatch_size
    ids = torch.randint(0, config.vocab_size, (rows, spec.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    tokens, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    sides: Sides = {}
    missing: dict[str, str] = {}
    if spec.compile and not stp_has_compile():
        missing["stp"] = STP_COMPILE_MISSING
    else:
        extra = {"compile": True} if spec.compile else {}
        trainer = Trainer(config, optimizer, schedule, pp=spec.pp, tp=spec.tp, dtype=dtype,
                          timeout=spec.timeout, **extra)
        sides["stp"] = lambda: trainer.step((tokens, targets))
    variants = [("torch", False)] + ([("torch-csv", True)] if spec.csv else [])
    if spec.csv and spec.compile:  # torch's compile check sits in its classes, not here
        variants.pop()
        missing["torch-csv"] = CSV_COMPILED
    for label, from_csv in variants:
        try:
            side = _torch_side(spec, name, schedule, optimizer, from_csv)
        except RuntimeError as e:  # PyTorch refuses the schedule (every rank alike)
            missing[label] = " ".join(str(e).split())
            continue
        sides[label] = lambda side=side: side.step(tokens, targets)
    return sides, missing


def _torch_side(spec: PeerSpec, name: str, schedule: Any, optimizer: Any,
                from_csv: bool) -> TorchSide:
    """The plain-module side at tp=1 eager (the earlier tables' torch side), else the
    torchtitan-style one (blocks, DTensor TP, per-block compile)."""
    dtype = getattr(torch, spec.dtype)
    if spec.tp == 1 and not spec.compile:
        return TorchSide(name, schedule, dist.get_rank(), spec.model, dtype, optimizer,
                         from_csv=from_csv)
    from stp.bench.peer_tp import TorchTPSide, peer_mesh

    return TorchTPSide(name, schedule, peer_mesh(spec.pp, spec.tp), spec.model, dtype,
                       optimizer, compile=spec.compile, from_csv=from_csv)


def _time(spec: PeerSpec, name: str, sides: Sides) -> dict[str, Any]:
    """Rounds of one step of every side in turn: wall times, ratios, CPU and faults;
    the first round's wall time (compilation included) and loss of each side."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[list[tuple[float, int]]]] = {k: [] for k in sides}
    first_s: dict[str, float] = {}
    first_loss: dict[str, float] = {}
    for r in range(spec.warmup + spec.pairs):
        for label, fn in sides.items():
            out: list[float] = []
            try:
                wall, per_rank = span(lambda fn=fn, out=out: out.append(fn()))
            except Exception as e:
                raise SideFailed(label) from e
            if r == 0:
                first_s[label], first_loss[label] = wall, out[0]
            if r >= spec.warmup:
                times[label].append(wall)
                cpu[label].append(per_rank)
    row: dict[str, Any] = {"schedule": name, "times": times, "cpu": cpu,
                           "first_s": first_s, "first_loss": first_loss}
    for label in sides:
        if label != "stp" and "stp" in sides:
            row[f"ratio_{label}"] = [a / b for a, b in zip(times["stp"], times[label],
                                                           strict=True)]
    return row


def peer_worker(spec: PeerSpec) -> dict[str, Any] | None:
    """Run every schedule of `spec` on this rank (world = pp x tp ranks, gloo); the
    figures on global rank 0 (and the profile text, if asked, on profile_rank)."""
    if dist.get_world_size() != spec.world:
        raise ValueError(f"the peer benchmark runs on pp x tp = {spec.world} ranks, "
                         f"the world has {dist.get_world_size()}")
    rank = dist.get_rank()
    built = {name: _sides(spec, name) for name in spec.schedules}
    rows = []
    for name in spec.schedules:
        sides, missing = built[name]
        try:
            rows.append(_time(spec, name, sides) | {"missing": missing})
        except SideFailed as e:  # reported as this schedule's row (see peer_entry)
            return {"error": error_line(e.__cause__ or e), "side": e.side,
                    "missing": missing, "rank": rank}
    for row in rows:
        if spec.profile_rank is not None:
            row["profile"] = {label: profile(fn, spec.pairs, rank == spec.profile_rank)
                              for label, fn in built[row["schedule"]][0].items()}
    for row in rows:  # last: it fixes glibc's mmap threshold for the rest of the process
        if spec.memory:
            row["peak_mib"] = {label: gather(peak_growth_mib(fn))
                               for label, fn in built[row["schedule"]][0].items()}
    if rank == 0 or rank == spec.profile_rank:
        return {"spec": spec, "rows": rows, "rank": rank}
    return None


def peer_entry(spec: PeerSpec) -> dict[str, Any] | None:
    """A launched worker (module level, spawned by name; stp.runtime.launch.launch_local).
    A side that fails mid-step (an error inside PyTorch's compiled backward) is
    returned as {"error": one line}, not raised: its peers then fail on the closed
    connections, return theirs, and run_peer reports the first cause."""
    return in_world(_guarded_worker, spec, spec.timeout)


def _guarded_worker(spec: PeerSpec) -> dict[str, Any] | None:
    try:
        return peer_worker(spec)
    except Exception as e:  # noqa: BLE001 - reported as the schedule's row
        return {"error": error_line(e), "rank": dist.get_rank()}


class SideFailed(Exception):
    """A side's step raised (the cause is chained)."""

    def __init__(self, side: str) -> None:
        super().__init__(f"{side} failed")
        self.side = side


def _first_line(e: BaseException) -> str:
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")


def error_line(e: BaseException, limit: int = 240) -> str:
    """One line for a table: the innermost cause (type and first line), after the
    outer error's first line when that says more (e.g. which backward failed)."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(root).__name__}: {_first_line(root)}"
    if root is not e and _first_line(e):
        text = f"{_first_line(e).rstrip(':')}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


_SECONDARY = ("Connection closed", "closed by peer", "Connection reset", "Broken pipe")
"""gloo's words on a rank whose peer stopped: an effect, not the cause."""


def run_peer(spec: PeerSpec) -> dict[str, Any]:
    """Start pp x tp local gloo workers (stp.runtime.launch.launch_local) once per
    schedule, measure, and return {"spec", "rows": the figures (`format_table`
    prints them), "profiles": {schedule: {side: cProfile text}} when
    spec.profile_rank is set}. A schedule whose run fails is a row whose sides
    say why (one launch each, so the others still run)."""
    out: dict[str, Any] = {"spec": spec, "rows": [], "profiles": {}}
    for name in spec.schedules:
        one = replace(spec, schedules=(name,))
        returns, error, side, missing = _launch(one)
        if error is not None:  # the failing side, or (unknown) both
            missing |= {s: error for s in ((side,) if side else ("stp", "torch"))}
            out["rows"].append({"schedule": name, "times": {}, "cpu": {}, "first_s": {},
                                "first_loss": {}, "missing": missing})
            continue
        out["rows"] += returns[0]["rows"]
        if spec.profile_rank is not None:
            for row in returns[spec.profile_rank]["rows"]:
                out["profiles"][row["schedule"]] = row.pop("profile")
    for row in out["rows"]:
        row.pop("profile", None)
    return out


def _launch(spec: PeerSpec) -> tuple[dict[int, Any], str | None, str | None, dict[str, str]]:
    """Every rank's return; on a failure its first cause ("run failed: ..."), the
    side whose step raised (None: not known) and the sides that had not run."""
    from stp.runtime.launch import launch_local

    result = launch_local(peer_entry, (spec,), spec.world)
    failed = [r for _, r in sorted(result.returns.items())
              if isinstance(r, dict) and "error" in r]
    first = ([r for r in failed if not any(w in r["error"] for w in _SECONDARY)]
             or failed)
    if first:
        r = first[0]
        return result.returns, f"run failed: {r['error']}", r.get("side"), r.get("missing", {})
    if result.exitcode:
        return result.returns, f"run failed: {result.cause or result.failed_ranks}", None, {}
    return result.returns, None, None, {}
