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

`count_sides`: per step, from torch.profiler's CPU events (any machine checks
them; the load does not change them): aten ops (every `aten::` event, nested
ones too), autograd nodes (`autograd::engine::evaluate_function`),
compiled-graph calls (inductor graphs called) and host synchronisations:
`aten::_local_scalar_dense` (`.item()`, `float(t)`, `int(t)`, `bool(t)`; those
inside an optimizer's step read its host step counters and are counted apart) and
the Python calls that read a device tensor on the host or wait for the device
(`Tensor.cpu`, `.tolist`, `torch.cuda.synchronize`,
`torch.cuda.mem_get_info`), counted by kind. On the CPU every tensor is a
host tensor, so a `.cpu()` / `.tolist()` there is counted as the wait it is on
a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from stp.bench.plain_loop import PlainModel, PlainShape, plain_step
from stp.runtime.launch import init_distributed
from stp.runtime.mesh import Mesh, ParallelDims
from stp.shapes import ModelConfig
from stp.train.run.config import ModelShape, TrainJob
from stp.train.run.job import check
from stp.train.run.loop import _options
from stp.train.step.lr import adamw
from stp.train.run.memory_measure import measure
from stp.train.run.mfu import device_peak, mfu, step_flops
from stp.train.step.trainer import Trainer

__all__ = ["SIDES", "SingleSpec", "build_sides", "count_sides", "counts_with_ratios",
           "time_sides"]

SIDES = ("plain eager", "stp eager", "plain compiled", "stp compiled")
STEP = "stp-single: step"
STEP_COUNTER = "stp-single: AdamW step counter"
"""torch's non-fused AdamW reads each parameter's step count with .item(); the count
is a CPU tensor for a GPU's parameters too (not capturable), so no sync."""


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
                      run.schedule, mesh=mesh, options=_options(run))

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
def _one_rank() -> Iterator[None]:
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
    with _one_rank():
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
            **_ratios(out, "ms_per_step"), **_ratios(out, "peak_bytes")}


def _ratios(rows: dict[str, dict[str, Any]], key: str) -> dict[str, float]:
    out = {}
    for mode in ("eager", "compiled"):
        s, p = rows.get(f"stp {mode}"), rows.get(f"plain {mode}")
        if s and p and s.get(key) is not None and p.get(key):
            out[f"{mode}_{key}_ratio"] = s[key] / p[key]
    return out


# -- per-step counts ---------------------------------------------------------------

_HOST_READS = ("cpu", "tolist")
"""`.numpy()` is not among them: it reads host tensors only (a device tensor refuses it),
so it never waits for a device; a check reading the host batch through it is free."""
_SCALAR_READS = ("item", "__float__", "__int__", "__bool__")
"""What reaches aten::_local_scalar_dense from Python; wrapped only to say where."""


def _place() -> str:
    """The innermost frame of the step outside this benchmark: where a host read is."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/stp/bench/single_device" in name or "/torch/" in name:
            continue
        short = name.split("/src/")[-1] if "/src/" in name else name.rsplit("/", 1)[-1]
        return f"{short}:{frame.lineno} {frame.name}"
    return "?"


@contextlib.contextmanager
def _host_reads(counts: Counter[str], places: Counter[str]) -> Iterator[None]:
    """Count the Python calls that read a tensor on the host or wait for the device,
    by kind (`counts`), and every host read by the place in the code it is made
    (`places`), while the step runs. AdamW's step-counter reads run inside a
    STEP_COUNTER range, told apart from the rest."""
    import torch.optim.adam as adam

    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS + _SCALAR_READS}
    cuda_saved = {name: getattr(torch.cuda, name) for name in ("synchronize", "mem_get_info")}
    get_value = adam._get_value
    in_counter = [False]

    def counted(fn: Callable[..., Any], kind: str | None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if not in_counter[0]:
                if kind is not None:
                    counts[kind] += 1
                places[_place()] += 1
            return fn(*args, **kwargs)
        return inner

    @functools.wraps(get_value)
    def step_counter(x: Any) -> Any:
        in_counter[0] = True
        try:
            with record_function(STEP_COUNTER):
                return get_value(x)
        finally:
            in_counter[0] = False

    adam._get_value = step_counter
    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(fn, f".{name}()" if name in _HOST_READS else None))
    for name, fn in cuda_saved.items():
        setattr(torch.cuda, name, counted(fn, f"torch.cuda.{name}"))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in cuda_saved.items():
            setattr(torch.cuda, name, fn)
        adam._get_value = get_value


def _step_counts(events: Any, steps: int) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    ops: Counter[str] = Counter()
    for ev in events:
        parents, parent = [], ev.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        if STEP not in parents:
            continue
        if ev.name.startswith("aten::"):
            counts["aten ops"] += 1
            ops[ev.name] += 1
        in_optimizer = any(p.startswith("Optimizer.step#") for p in parents)
        if ev.name == "aten::_local_scalar_dense" and (STEP_COUNTER in parents or in_optimizer):
            # AdamW's step counts: host tensors read inside the optimizer's step (the
            # fused kernel's too), on the device with a GPU's fused/capturable state
            counts["AdamW step-counter reads (host tensors, no sync)"] += 1
        elif ev.name == "aten::_local_scalar_dense":
            counts["host syncs"] += 1
            counts["sync: .item()"] += 1
        if ev.name.startswith("autograd::engine::evaluate_function"):
            counts["autograd nodes"] += 1
        if ev.name.startswith("## Call") and "CompiledFxGraph" in ev.name:
            counts["compiled graph calls"] += 1
    out: dict[str, Any] = {k: v / steps for k, v in counts.items()}
    out["aten ops by name"] = {k: v / steps for k, v in ops.most_common()}
    return out


def count_sides(spec: SingleSpec, *, sides: tuple[str, ...] = ("plain eager", "stp eager"),
                steps: int = 2, warmup: int = 2) -> dict[str, dict[str, Any]]:
    """Per side, counts per step (module doc) over `steps` profiled steps after `warmup`
    (which compiles a compiled side)."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, _one_rank():
        built, _ = build_sides(spec, sides, tmp, warmup + steps)
        for name, side in built.items():
            for k in range(warmup):
                side.step(k)
            reads: Counter[str] = Counter()
            places: Counter[str] = Counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for k in range(warmup, warmup + steps):
                    with record_function(STEP), _host_reads(reads, places):
                        side.step(k)
            row: dict[str, Any] = _step_counts(prof.events(), steps)
            for kind, n in reads.items():
                row[f"sync: {kind}"] = n / steps
                row["host syncs"] = row.get("host syncs", 0.0) + n / steps
            for key in ("aten ops", "autograd nodes", "compiled graph calls", "host syncs"):
                row.setdefault(key, 0.0)
            row["host reads by place"] = {k: v / steps for k, v in places.most_common()}
            out[name] = row
    return out


def counts_with_ratios(counts: dict[str, dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """`count_sides`' result with the ratios stp / plain of aten ops, and per mode the
    `top` aten ops stp runs most more often than the plain loop (where to cut)."""
    out: dict[str, Any] = {"sides": counts}
    out.update(_ratios(counts, "aten ops"))
    for mode in ("eager", "compiled"):
        s, p = counts.get(f"stp {mode}"), counts.get(f"plain {mode}")
        if s and p:
            mine, theirs = s["aten ops by name"], p["aten ops by name"]
            more = {k: mine.get(k, 0) - theirs.get(k, 0) for k in set(mine) | set(theirs)}
            out[f"{mode} aten ops stp runs more"] = {
                k: [mine.get(k, 0), theirs.get(k, 0)]
                for k in sorted(more, key=lambda k: -more[k])[:top]}
    return {k.replace("aten ops", "aten_ops"): v for k, v in out.items()}

