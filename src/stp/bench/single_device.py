"""stp on one device against the loop a user writes without it (stp.bench.plain_loop).

Both sides train the same shape on the same batches (`stp train`'s data: the
global batch of each step, cut into the same microbatches) with the same
optimizer settings (AdamW, betas (0.9, 0.95), eps 1e-8, no weight decay, the
run's learning rate, global-norm clipping), fp32 parameters, bfloat16 compute
on a GPU (stp: bf16 weights with fp32 masters; the plain loop: autocast), float32
on the CPU. The stp side is the Trainer `stp train --pp 1 --schedule 1f1b`
builds (stp.train.run.loop), in this process, and its step is what the loop runs
per step outside evaluation and checkpoints: `Trainer.step` (which moves the
host batch to the device, as in `stp train`; the plain loop's microbatches are
on the device beforehand: 8 bytes a token, a negligible copy), the activation
peaks and the step's update figures.

`time_sides`: rounds alternating between the two sides of a mode (eager, then
compiled, each pair alone in memory),
ms per step (median over rounds of each round's median), tokens/s, MFU (the
model FLOPs `stp plan` counts, stp.train.run.mfu), resident bytes (the side's own
parameters, gradients and optimizer state, counted by storage), on a GPU peak
bytes (resident, plus the most its step allocated above what the process held
before it) and the ratios stp / plain.

The same sides counted per step (aten ops, autograd nodes, host syncs) are
stp.bench.step_counts.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stp.bench.plain_loop import PlainModel, PlainShape, plain_step
from stp.runtime.launch import init_distributed
from stp.runtime.mesh import Mesh, ParallelDims
from stp.shapes import ModelConfig
from stp.train.run.config import ModelShape, TrainJob
from stp.train.run.job import check
from stp.train.run.memory_measure import measure
from stp.train.run.mfu import device_peak, mfu, step_flops
from stp.train.step.lr import adamw
from stp.train.step.trainer import Trainer

__all__ = ["SIDES", "SingleSpec", "build_sides", "one_rank", "stp_over_plain", "time_sides"]

SIDES = ("plain eager", "stp eager", "plain compiled", "stp compiled")


@dataclass(frozen=True)
class SingleSpec:
    """One shape and its batch on one device."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4
    seq_len: int = 64
    microbatches: int = 4
    microbatch_size: int = 2
    clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    """cpu, or cuda (bfloat16 compute)."""

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.microbatch_size * self.seq_len

    def job(self, compiled: bool, out: str) -> TrainJob:
        """The `stp train` flags of this spec."""
        return TrainJob(pp=1, schedule="1f1b", microbatches=self.microbatches,
                        microbatch_size=self.microbatch_size, seed=self.seed,
                        model=ModelShape(layers=self.layers, hidden=self.hidden,
                                         heads=self.heads, kv_heads=self.kv_heads,
                                         seq_len=self.seq_len),
                        dtype=self.dtype, clip_grad=self.clip, compile=compiled, out=out,
                        steps=1)


@dataclass
class Side:
    """One side of the comparison, built and ready to step."""

    step: Callable[[int], Any]
    """Runs step k (its batch prepared beforehand)."""
    resident: Callable[[], int]
    """Bytes of the side's parameters, gradients and optimizer state now."""


def _storage_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _stp_side(spec: SingleSpec, compiled: bool, batches: list[Any], out: str) -> Side:
    run = check(spec.job(compiled, out))
    job = run.job
    mesh = Mesh.from_world(ParallelDims(1, 1, 1, 1), timeout=job.timeout)
    trainer = Trainer(run.stage_model(), adamw(job.lr, weight_decay=job.weight_decay),
                      run.schedule, mesh=mesh, options=run.trainer_options())

    def step(k: int) -> Any:  # the loop's per-step work (stp.train.run.loop.run)
        loss = trainer.step(batches[k % len(batches)])
        trainer.activation_peaks()
        return loss, trainer.last_update

    return Side(step, lambda: measure(trainer, 0)["total"])


def _plain_side(spec: SingleSpec, compiled: bool, batches: list[Any], lr: float) -> Side:
    cfg = ModelConfig(vocab_size=256, hidden=spec.hidden, num_layers=spec.layers,
                      num_heads=spec.heads, num_kv_heads=spec.kv_heads,
                      max_seq_len=spec.seq_len)
    shape = PlainShape(layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                       kv_heads=spec.kv_heads, ffn=cfg.ffn_hidden, vocab=256,
                       seq_len=spec.seq_len, rope_theta=cfg.rope_theta, eps=cfg.norm_eps)
    device = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    model = PlainModel(shape).to(device)
    run, opt = plain_step(model, lr=lr, clip=spec.clip, compiled=compiled)
    m, b = spec.microbatches, spec.microbatch_size
    micro = [[(t[i * b:(i + 1) * b].to(device), y[i * b:(i + 1) * b].to(device))
              for i in range(m)] for t, y in batches]

    def resident() -> int:
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [v for s in opt.state.values() for v in s.values()]
        return _storage_bytes(params + grads + state)

    return Side(lambda k: run(micro[k % len(micro)]), resident)


def _batches(spec: SingleSpec, out: str, steps: int) -> tuple[list[Any], float, float | None]:
    """stp train's first `steps` global batches, its learning rate and the step's model
    FLOPs (the same for both sides: the same shape)."""
    run = check(spec.job(False, out))
    data = run.family.batches(run)
    return [data.batch(k) for k in range(steps)], run.job.lr, step_flops(run)


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """The one-rank world the stp side runs in, left afterwards when this made it (a
    process that goes on, a test run, must not find a group it did not start)."""
    mine = not dist.is_initialized()
    try:
        yield
    finally:
        if mine and dist.is_initialized():
            dist.destroy_process_group()


def build_sides(spec: SingleSpec, sides: tuple[str, ...], out: str,
                steps: int) -> tuple[dict[str, Side], float | None]:
    """The named sides (SIDES) on spec's device, and the model FLOPs of one step."""
    init_distributed(timeout=600.0, device=torch.device(spec.device))  # one rank, or kept
    batches, lr, flops = _batches(spec, out, steps)
    built: dict[str, Side] = {}
    for name in sides:
        who, mode = name.split()
        compiled = mode == "compiled"
        if who == "stp":
            built[name] = _stp_side(spec, compiled, batches, f"{out}/{mode}")
        else:
            built[name] = _plain_side(spec, compiled, batches, lr)
    return built, flops


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(spec: SingleSpec, side: Side, k: int,
           steps: int) -> tuple[list[float], int, int | None]:
    """Per-step seconds of `steps` steps from step k, the side's resident bytes and, on
    a GPU, its peak bytes (None on the CPU: no allocator statistics there)."""
    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    own = side.resident()
    times = []
    for j in range(steps):
        _sync(spec.device)
        start = time.perf_counter()
        side.step(k + j)
        _sync(spec.device)
        times.append(time.perf_counter() - start)
    peak = own + torch.cuda.max_memory_allocated() - before if cuda else None
    return times, own, peak


def _time_group(spec: SingleSpec, sides: tuple[str, ...], rounds: int, steps: int,
                warmup: int) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Build `sides`, warm them up (compiling), alternate `rounds` of `steps` steps
    between them, and free them: per side its round medians, bytes and warm-up."""
    with tempfile.TemporaryDirectory() as out:
        built, flops = build_sides(spec, sides, out, warmup + rounds * steps)
        rows: dict[str, dict[str, Any]] = {}
        for name, side in built.items():  # warm-up: the compiled sides compile here
            start = time.perf_counter()
            for k in range(warmup):
                side.step(k)
            _sync(spec.device)
            rows[name] = {"warmup_s": time.perf_counter() - start, "round_s": [],
                          "resident_bytes": 0, "peak_bytes": None}
        for r in range(rounds):
            for name, side in built.items():
                times, own, peak = _timed(spec, side, warmup + r * steps, steps)
                row = rows[name]
                row["round_s"].append(statistics.median(times))
                row["resident_bytes"] = max(row["resident_bytes"], own)
                if peak is not None:
                    row["peak_bytes"] = max(row["peak_bytes"] or 0, peak)
        del built
    if spec.device == "cuda":
        torch.cuda.empty_cache()
    return rows, flops


def time_sides(spec: SingleSpec, *, sides: tuple[str, ...] = SIDES, rounds: int = 3,
               steps: int = 3, warmup: int = 2, hardware: str | None = None) -> dict[str, Any]:
    """Alternating rounds (module doc): per side ms/step, tokens/s, MFU, bytes; and the
    ratios stp / plain, eager against eager and compiled against compiled. The eager
    pair runs first, then the compiled pair, each alone in memory (at 2.8B parameters
    a side holds about 50 GB: fp32 weights, gradients and AdamW's two moments)."""
    measured: dict[str, dict[str, Any]] = {}
    flops = None
    with one_rank():
        for mode in ("eager", "compiled"):
            group = tuple(name for name in sides if name.endswith(mode))
            if group:
                rows, flops = _time_group(spec, group, rounds, steps, warmup)
                measured.update(rows)
    peak = device_peak(torch.device(spec.device), spec.dtype, hardware)
    out: dict[str, dict[str, Any]] = {}
    for name in sides:
        row = measured[name]
        step_s = statistics.median(row["round_s"])
        out[name] = {"ms_per_step": 1e3 * step_s, "tokens_per_s": spec.tokens_per_step / step_s,
                     "mfu": mfu(flops, step_s, 1, peak), "peak_bytes": row["peak_bytes"],
                     "resident_bytes": row["resident_bytes"], "warmup_s": row["warmup_s"],
                     "round_ms": [1e3 * t for t in row["round_s"]]}
    return {"spec": spec.__dict__ | {"dtype": spec.dtype}, "step_flops": flops,
            "peak": None if peak is None else peak.__dict__, "sides": out,
            **stp_over_plain(out, "ms_per_step"), **stp_over_plain(out, "peak_bytes")}


def stp_over_plain(rows: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    """Per mode, `<mode>_<key>_ratio`: the stp side's `key` over the plain loop's."""
    out = {}
    for mode in ("eager", "compiled"):
        s, p = rows.get(f"stp {mode}"), rows.get(f"plain {mode}")
        if s and p and s.get(key) is not None and p.get(key):
            out[f"{mode}_{key}_ratio"] = s[key] / p[key]
    return out
