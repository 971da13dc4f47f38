"""Where a step's time goes on each side of the peer benchmark (stp.bench.peer),
per rank, from torch.profiler's CPU events.

Both sides are built as the peer benchmark builds them (`stp.bench.peer._sides`:
the same model, batch, schedule and compile setting), warmed up (compiled),
then run `rounds` unprofiled steps each, alternating, for the CPU time per
step, and `steps` profiled steps each. Every profiled step runs inside a
`step` range, so each event's self time (the time inside it and not inside a
child event) falls into exactly one bucket (`bucket`), and the buckets of a
step add up to its wall time on that rank:

  matmul       aten::mm / addmm / bmm / matmul / linear (the BLAS calls)
  attention    SDPA forward and backward (fused kernels on both sides)
  inductor     inside a call of an inductor-compiled graph, outside any aten op
               in it: the generated C++ kernels and the graph's Python wrapper
  compile glue TorchDynamo's compiled region, AOTAutograd's autograd Function,
               guard checks: the per-call price of a compiled piece or block
  other aten   every other aten op (element-wise, views, copies, reductions)
  autograd     the autograd engine's own work per node (evaluate_function, the
               node ranges) and autograd Functions' Python bodies (stp's *Fn)
  collective   TP collectives and the waits on them (c10d / gloo ops, DTensor's
               functional collectives and wait_tensor, Work.wait outside p2p)
  p2p          pipeline sends and receives and the waits on them
  rest         the step range's own time: Python (runtime, model code), the
               dispatcher outside any op, the optimizer's Python

Event times are wall times on the rank's thread (a rank descheduled by a
loaded machine is charged where it was), so the CPU time per step, measured
apart, is the fairer total. The per-step counts (aten ops, compiled-graph
calls, autograd nodes) do not depend on the load.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from stp.bench.peer import PeerSpec, _sides
from stp.bench.probes import gather
from stp.bench.world import in_world

__all__ = ["BUCKETS", "ProfileSpec", "bucket", "profile_entry", "run_profile"]

BUCKETS = ("matmul", "attention", "inductor", "compile glue", "other aten", "autograd",
           "collective", "p2p", "rest")

STEP = "stp-profile: step"
P2P_WAIT = "stp-profile: p2p wait"
WORK_WAIT = "stp-profile: Work.wait"

_MATMUL = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
           "aten::matmul", "aten::linear", "aten::_addmm_activation"}
_COLLECTIVE = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
               "wait_tensor", "broadcast", "record_param_comms", "gloo:")
_P2P = ("c10d::send", "c10d::recv", "batch_isend_irecv", "isend", "irecv")
_GLUE = ("Torch-Compiled Region", "CompiledFunction", "TorchDynamo", "Guard",
         "_compile", "AOTDispatcher", "Pregraph bytecode")


def bucket(name: str, parents: tuple[str, ...]) -> str:
    """The bucket (BUCKETS) of an event's self time, from its name and its ancestors'
    names (innermost first)."""
    if name == STEP:
        return "rest"
    if name == P2P_WAIT or any(name.startswith(p) for p in _P2P):
        return "p2p"
    if name == WORK_WAIT:
        return "p2p" if P2P_WAIT in parents else "collective"
    low = name.lower()
    if any(c in low for c in _COLLECTIVE):
        return "collective"
    if name in _MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name.startswith("cpp_fused") or name.startswith("kernel_cpp") or (
            "CompiledFxGraph" in name and name.startswith("## Call")):
        return "inductor"  # the graph's kernels run inside its call range
    if any(name.startswith(g) for g in _GLUE) or "dynamo" in low:
        return "compile glue"
    if name.startswith("aten::"):
        return "other aten"
    if (name.startswith("autograd::") or "Backward" in name or name.startswith("torch::autograd")
            or name.endswith("Fn")):  # a Function's Python forward (stp's are named *Fn)
        return "autograd"
    return "rest"


@dataclass(frozen=True)
class ProfileSpec:
    """One profiled comparison: the peer benchmark's setting and how much to run."""

    peer: PeerSpec
    steps: int = 3
    """Profiled steps per side (after the warm-up and the timed rounds)."""
    rounds: int = 3
    """Unprofiled steps per side, alternating, for the CPU time per step."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.rounds < 1:
            raise ValueError(f"steps and rounds must be >= 1, got {self.steps}, {self.rounds}")


@contextmanager
def _labelled_waits() -> Iterator[None]:
    """Every Work.wait in a range of its own, and the pipelines' p2p waits (stp's
    P2P.wait, torch pipelining's _wait_batch_p2p) in a p2p range around it."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from stp.runtime.p2p import P2P

    def ranged(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)
        return inner

    saved = (dist.Work.wait, P2P.wait, torch_schedules._wait_batch_p2p)
    dist.Work.wait = ranged(saved[0], WORK_WAIT)
    P2P.wait = ranged(saved[1], P2P_WAIT)
    torch_schedules._wait_batch_p2p = ranged(saved[2], P2P_WAIT)
    try:
        yield
    finally:
        dist.Work.wait, P2P.wait, torch_schedules._wait_batch_p2p = saved


def _breakdown(events: Any, steps: int) -> dict[str, Any]:
    """Milliseconds per step in each bucket, and counts per step, from the profiler's
    events (only those inside a step range count)."""
    ms = dict.fromkeys(BUCKETS, 0.0)
    counts: Counter[str] = Counter()
    top: Counter[str] = Counter()
    for ev in events:
        parents, p = [], ev.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        if ev.name != STEP and STEP not in parents:
            continue
        b = bucket(ev.name, tuple(parents))
        ms[b] += ev.self_cpu_time_total / 1e3
        top[f"{b}: {ev.name}"] += ev.self_cpu_time_total / 1e3
        if ev.name.startswith("aten::"):
            counts["aten ops"] += 1
        if ev.name in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"):
            counts["BLAS calls"] += 1
        if b == "inductor" and ev.name.startswith("## Call"):
            counts["compiled graph calls"] += 1
        if ev.name.startswith("autograd::engine::evaluate_function"):
            counts["autograd nodes"] += 1
    return {"ms": {k: v / steps for k, v in ms.items()},
            "counts": {k: v / steps for k, v in counts.items()},
            "top": [(k, v / steps) for k, v in top.most_common(40)]}


def _profiled(fn: Callable[[], Any], steps: int) -> dict[str, Any]:
    with _labelled_waits(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier()
            with record_function(STEP):
                fn()
    return _breakdown(prof.events(), steps)


def profile_worker(spec: ProfileSpec) -> dict[str, Any] | None:
    """Every schedule of spec.peer on this rank: per side, the median CPU ms per step
    (unprofiled: the process's, its communication threads included, and the main
    thread's alone) and the profiled breakdown; rank 0 returns every rank's."""
    peer = spec.peer
    out: dict[str, Any] = {}
    for name in peer.schedules:
        sides, missing = _sides(peer, name)
        for _ in range(peer.warmup):
            for fn in sides.values():
                fn()
        cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        for _ in range(spec.rounds):
            for label, fn in sides.items():
                dist.barrier()
                start, main = time.process_time(), time.thread_time()
                fn()
                cpu[label].append((time.process_time() - start, time.thread_time() - main))
        row = {label: {"cpu_ms": 1e3 * statistics.median(c for c, _ in cpu[label]),
                       "main_ms": 1e3 * statistics.median(m for _, m in cpu[label]),
                       **_profiled(fn, spec.steps)} for label, fn in sides.items()}
        out[name] = {"sides": row, "missing": missing}
    every = gather(out)
    return {"spec": spec, "ranks": every} if dist.get_rank() == 0 else None


def profile_entry(spec: ProfileSpec) -> dict[str, Any] | None:
    """A launched worker (stp.runtime.launch.launch_local spawns it by name)."""
    return in_world(profile_worker, spec, spec.peer.timeout)


def run_profile(spec: ProfileSpec) -> dict[str, Any]:
    """Launch pp x tp local gloo workers and return rank 0's result:
    {"spec", "ranks": [per rank {schedule: {"sides": {side: {cpu_ms, ms, counts,
    top}}, "missing"}}]}. RuntimeError (one line) if the run failed."""
    from stp.runtime.launch import launch_local

    result = launch_local(profile_entry, (spec,), spec.peer.world)
    if result.exitcode or 0 not in result.returns:
        raise RuntimeError(f"profile run failed: {result.cause or result.failed_ranks}")
    return result.returns[0]


def format_breakdown(result: dict[str, Any]) -> str:
    """One Markdown table: per schedule, side and rank, ms per step in each bucket,
    the bucket sum (the profiled wall per step), the unprofiled CPU ms, and counts."""
    spec: ProfileSpec = result["spec"]
    lines = ["| setting | schedule | side | rank | " + " | ".join(BUCKETS)
             + " | sum | CPU ms (unprofiled) | of which main thread | aten ops | BLAS calls "
             "| compiled calls | autograd nodes |", "|---" * (len(BUCKETS) + 11) + "|"]
    for name in spec.peer.schedules:
        for side in result["ranks"][0][name]["sides"]:
            for r, ranks in enumerate(result["ranks"]):
                d = ranks[name]["sides"][side]
                c = d["counts"]
                lines.append(
                    f"| {spec.peer.label} | {name} | {side} | {r} | "
                    + " | ".join(f"{d['ms'][b]:.1f}" for b in BUCKETS)
                    + f" | {sum(d['ms'].values()):.1f} | {d['cpu_ms']:.1f} | "
                    f"{d['main_ms']:.1f} | "
                    f"{c.get('aten ops', 0):.0f} | {c.get('BLAS calls', 0):.0f} | "
                    f"{c.get('compiled graph calls', 0):.0f} | "
                    f"{c.get('autograd nodes', 0):.0f} |")
        for side, why in result["ranks"][0][name]["missing"].items():
            lines.append(f"| {spec.peer.label} | {name} | {side} | - | not run: {why} |")
    return "\n".join(lines)
