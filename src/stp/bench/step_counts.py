"""What one step of each side of stp.bench.single_device does, counted (`count_sides`):
per step, from torch.profiler's CPU events (any machine checks
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
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from stp.bench.single_device import SingleSpec, build_sides, one_rank, stp_over_plain

__all__ = ["STEP", "STEP_COUNTER", "count_sides", "counts_with_ratios"]

STEP = "stp-single: step"
STEP_COUNTER = "stp-single: AdamW step counter"
"""torch's non-fused AdamW reads each parameter's step count with .item(); the count
is a CPU tensor for a GPU's parameters too (not capturable), so no sync."""

_HOST_READS = ("cpu", "tolist")
"""`.numpy()` is not among them: it reads host tensors only (a device tensor refuses it),
so it never waits for a device; a check reading the host batch through it is free."""
_SCALAR_READS = ("item", "__float__", "__int__", "__bool__")
"""What reaches aten::_local_scalar_dense from Python; wrapped only to say where."""


def _place() -> str:
    """The innermost frame of the step outside this benchmark: where a host read is."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/stp/bench/single_device" in name or "/stp/bench/step_counts" in name \
                or "/torch/" in name:
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
    with tempfile.TemporaryDirectory() as tmp, one_rank():
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
    out.update(stp_over_plain(counts, "aten ops"))
    for mode in ("eager", "compiled"):
        s, p = counts.get(f"stp {mode}"), counts.get(f"plain {mode}")
        if s and p:
            mine, theirs = s["aten ops by name"], p["aten ops by name"]
            more = {k: mine.get(k, 0) - theirs.get(k, 0) for k in set(mine) | set(theirs)}
            out[f"{mode} aten ops stp runs more"] = {
                k: [mine.get(k, 0), theirs.get(k, 0)]
                for k in sorted(more, key=lambda k: -more[k])[:top]}
    return {k.replace("aten ops", "aten_ops"): v for k, v in out.items()}

