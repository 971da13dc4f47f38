"""What a request that has no plan would need, said in one line.

Two ways a request fails:

* no mesh: no pp x tp x dp = GPUs admits the model and the batch (tp must
  divide the node and the heads, dp the global batch, pp leave every stage a
  layer; with `--ep`, dp must divide by one of its sizes). The answer names
  the nearest GPU counts below and above that do.
* nothing fits: every configuration is over the memory budget even with
  every lever on. The answer names the closest configuration and its peak,
  and the smallest GPU count (a multiple of the node, up to 64 times the
  request) at which the planner finds a plan that fits; the counts between
  are ruled out by the memory bound or by planning them. For a mixture of
  experts it also names the expert-parallel sizes its experts admit (or the
  `--ep` sizes the request was held to): experts that no ep large enough
  divides are a reason a model fits nowhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stp.costmodel.memory import format_bytes
from stp.plan.experts import bound_memory
from stp.plan.request import MAX_GPUS, PlanRequest
from stp.plan.space import Config, levers_for, meshes, microbatchings, schedules_for

__all__ = ["NoPlan", "explain_no_mesh", "explain_no_fit", "bound_admits"]


class NoPlan(ValueError):
    """No configuration fits: the message says what would be needed."""

_SCAN = 4096
"""GPU counts tried either side of a request without a mesh."""
_MAX_PLANS = 4
"""GPU counts actually planned when looking for the smallest that fits."""


def _has_mesh(request: PlanRequest, gpus: int) -> bool:
    return next(iter(meshes(replace(request, gpus=gpus))), None) is not None


def explain_no_mesh(request: PlanRequest) -> str:
    below = next((n for n in range(request.gpus - 1, max(request.gpus - _SCAN, 0), -1)
                  if _has_mesh(request, n)), None)
    above = next((n for n in range(request.gpus + 1, min(request.gpus + _SCAN, MAX_GPUS))
                  if _has_mesh(request, n)), None)
    near = " or ".join(str(n) for n in (below, above) if n is not None) or "none nearby"
    m = request.model
    ep = ("" if request.ep is None else
          f" and by one of --ep {','.join(map(str, request.ep))}")
    return (f"--gpus {request.gpus}: no pp x tp x dp mesh fits the model ({m.layers} layers, "
            f"{m.heads} heads, {m.kv_heads} kv heads), tp within --gpus-per-node "
            f"{request.gpus_per_node} and dp dividing --global-batch {request.global_batch}"
            f"{ep}; GPU counts that do: {near}")


def bound_admits(request: PlanRequest) -> bool:
    """Whether some configuration's memory bound fits (a plan needs it)."""
    for mesh in meshes(request):
        ladder = levers_for(request, mesh)
        for b, m in microbatchings(request, mesh):
            for name, chunks in schedules_for(request, mesh):
                cfg = Config(mesh, b, m, name, ladder[-1][1], chunks)
                if bound_memory(request, cfg) <= request.budget:
                    return True
    return False


def _larger_counts(request: PlanRequest) -> list[int]:
    node = request.gpus_per_node
    first = (request.gpus // node + 1) * node
    return [n for n in range(first, min(64 * request.gpus, MAX_GPUS) + 1, node)]


def _smallest_fitting(request: PlanRequest, plan: Callable[[PlanRequest], Any]) -> int | None:
    planned = 0
    for n in _larger_counts(request):
        bigger = replace(request, gpus=n, top=1)
        if not _has_mesh(bigger, n) or not bound_admits(bigger):
            continue
        try:
            plan(bigger)
            return n
        except NoPlan:
            planned += 1
            if planned >= _MAX_PLANS:
                return None
    return None


def explain_no_fit(request: PlanRequest, result: Any,
                   plan: Callable[[PlanRequest], Any]) -> str:
    """`result`: the failed search (its `rejected`); `plan`: the planner, run
    on larger GPU counts."""
    budget = format_bytes(request.budget)
    closest = ""
    if result.rejected:
        best = result.rejected[0]
        c = best.config
        ep = f" ep={c.mesh.ep}" if request.model.has_experts else ""
        closest = (f"; the closest, pp={c.mesh.pp} tp={c.mesh.tp} dp={c.mesh.dp}{ep} "
                   f"{c.schedule} with every lever on, needs "
                   f"{format_bytes(best.peak_bytes)} on rank {best.estimate.peak.rank}")
    need = _smallest_fitting(request, plan)
    where = (f"{need} GPUs would fit" if need is not None
             else f"no count up to {min(64 * request.gpus, MAX_GPUS)} GPUs fits either")
    return (f"no configuration of {request.gpus} GPUs fits {budget} per GPU "
            f"(--memory-budget or the hardware's memory){closest}{_ep_tried(request)}; "
            f"{where}")


def _ep_tried(request: PlanRequest) -> str:
    """For a mixture of experts: the expert-parallel sizes its experts admit (the
    planner tried those dividing dp), or the --ep sizes it was held to."""
    m = request.model
    if not m.has_experts:
        return ""
    if request.ep is not None:
        return f" (held to --ep {','.join(map(str, request.ep))})"
    admits = m.ep_sizes()  # the divisors of its experts, the last all of them
    return (f" (its {admits[-1]} experts admit ep {', '.join(map(str, admits))}, each "
            "dividing dp)")
