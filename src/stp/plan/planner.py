"""`plan`: the fastest configurations of a model on a cluster that fit its memory.

Method (best-first branch and bound, so that most configurations are never
simulated):

1. Enumerate (`stp.plan.space`): meshes, microbatchings, schedules; each
   starts at the first rung of the memory-lever ladder that its memory
   bound (`stp.plan.price.memory_bound`) does not already rule out. A
   configuration whose last rung is ruled out is dropped unsimulated.
2. Keep them in a heap ordered by their time bound (`time_bound`). Pop the
   smallest; once K configurations fit and the smallest bound left exceeds
   the K-th best simulated step, nothing left can enter the top K: stop.
3. A popped configuration is simulated at its rung (`stp.plan.price.price`,
   the estimate `stp memory` prints), unless a later rung remains and its
   nearly exact memory bound (`exact_memory_bound`: the estimate without
   simulating, less the gradient copies) is over the budget. Over the
   budget: it goes back at the next rung that its bound admits (a slower
   rung has a larger bound). Simulations are shared by rungs that change
   model states only (`stp.plan.price`).
4. The top K then try the balanced layer partition (the classic one that
   prices the embedding and output layer, `stp.search.partition`) and, where
   the simulation is cheap, `--partition auto`; a partition is kept when it
   fits and is faster.
5. The top K then try the TP overlap modes (`stp.plan.overlap`: braiding off,
   in-layer overlap at K = 2, 4, 8 chunks, the hybrid); a mode is kept when
   it fits and is faster.

Every plan returned was priced by the same estimate `stp memory` makes, so
its peak rank is within the budget by construction.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from stp.costmodel.decoder.costs import derive_decoder
from stp.costmodel.stages import layered_costs
from stp.plan.experts import (
    bound_exact,
    bound_memory,
    bound_time,
    hardware_of,
    model_at,
    priced,
)
from stp.plan.needs import NoPlan, explain_no_fit, explain_no_mesh
from stp.plan.overlap import overlapped
from stp.plan.price import Priced, spec_for
from stp.plan.request import PlanRequest
from stp.plan.space import (
    MAX_STAGE_MICROBATCHES,
    Config,
    Mesh,
    levers_for,
    meshes,
    microbatchings,
    schedules_for,
    stages_of,
)
from stp.schedule.registry import generate
from stp.search.partition import auto_partition, balanced_partition

__all__ = ["PlanResult", "Progress", "plan", "priced_at", "NoPlan"]

AUTO_PARTITION_WORK = 512
"""Stages x microbatches up to which the top plans also run `--partition auto`
(each of its rounds simulates 2 (S - 1) partitions)."""


@dataclass
class PlanResult:
    """The ranked plans and how much work ranking them took."""

    plans: list[Priced]
    request: PlanRequest
    considered: int = 0
    """Configurations enumerated (mesh x microbatching x schedule)."""
    pruned_memory: int = 0
    """Dropped unsimulated: even the last lever's memory bound is over budget."""
    pruned_time: int = 0
    """Left unsimulated: their time bound was past the K-th best step."""
    simulated: int = 0
    """Simulations (a configuration over the budget is simulated again at its
    next lever)."""
    seconds: float = 0.0
    rejected: list[Priced] = field(default_factory=list)
    """Simulated but over the budget at their last rung (the smallest first)."""
    skipped_rungs: int = 0
    """Lever rungs passed over unsimulated: their nearly exact memory bound
    (`stp.plan.price.exact_memory_bound`) was already over the budget."""
    fitted: int = 0
    """Simulated configurations that fit the budget (the top K among them)."""
    best_s: float | None = None
    """The fastest step that fits found so far (None: none yet)."""


Progress = Callable[[PlanResult], None]
"""Called as the search goes (the counts and `best_s` so far): `stp plan` prints a
progress line from it on a terminal."""


def _quiet(result: PlanResult) -> None:
    pass


@dataclass(order=True)
class _Item:
    bound: float
    order: int
    rung: int = field(compare=False)
    base: Config = field(compare=False)
    ladder: list = field(compare=False)


def _first_rung(request: PlanRequest, base: Config, ladder: list, start: int) -> int | None:
    """The first rung from `start` whose memory bound fits the budget."""
    for i in range(start, len(ladder)):
        cfg = replace(base, features=ladder[i][1])
        if bound_memory(request, cfg) <= request.budget:
            return i
    return None


def _seed(request: PlanRequest, result: PlanResult, progress: Progress) -> list[_Item]:
    heap: list[_Item] = []
    counter = itertools.count()
    for mesh in meshes(request):
        ladder = levers_for(request, mesh)
        for b, m in microbatchings(request, mesh):
            for name, chunks in schedules_for(request, mesh):
                if stages_of(name, mesh.pp, chunks) * m > MAX_STAGE_MICROBATCHES:
                    continue
                result.considered += 1
                progress(result)
                base = Config(mesh, b, m, name, ladder[0][1], chunks)
                rung = _first_rung(request, base, ladder, 0)
                if rung is None:
                    result.pruned_memory += 1
                    continue
                cfg = replace(base, features=ladder[rung][1])
                bound = bound_time(request, cfg)
                heap.append(_Item(bound, next(counter), rung, base, ladder))
    heapq.heapify(heap)
    return heap


def _search(request: PlanRequest, result: PlanResult, progress: Progress) -> list[Priced]:
    heap = _seed(request, result, progress)
    fits: list[Priced] = []
    kth = float("inf")
    over: list[Priced] = []
    priced_orders: set[int] = set()
    while heap:
        item = heapq.heappop(heap)
        if len(fits) >= request.top and item.bound > kth:
            break
        progress(result)
        cfg = replace(item.base, features=item.ladder[item.rung][1])
        nxt = _first_rung(request, item.base, item.ladder, item.rung + 1)
        exact = None if nxt is None else bound_exact(request, cfg)
        if exact is not None and exact > request.budget:
            # over the budget without simulating (module doc, step 3): the next rung
            result.skipped_rungs += 1
            assert nxt is not None
            nxt_cfg = replace(item.base, features=item.ladder[nxt][1])
            heapq.heappush(heap, _Item(bound_time(request, nxt_cfg), item.order, nxt,
                                       item.base, item.ladder))
            continue
        got = priced(request, cfg)
        result.simulated += 1
        priced_orders.add(item.order)
        if got.peak_bytes <= request.budget:
            result.fitted += 1
            if result.best_s is None or got.step_s < result.best_s:
                result.best_s = got.step_s
            fits.append(got)
            fits.sort(key=lambda p: p.step_s)
            del fits[request.top:]
            kth = fits[-1].step_s if len(fits) >= request.top else float("inf")
            continue
        nxt = _first_rung(request, item.base, item.ladder, item.rung + 1)
        if nxt is None:
            over.append(got)
            continue
        nxt_cfg = replace(item.base, features=item.ladder[nxt][1])
        bound = bound_time(request, nxt_cfg)
        heapq.heappush(heap, _Item(bound, item.order, nxt, item.base, item.ladder))
    result.rejected = sorted(over, key=lambda p: p.peak_bytes)[:3]
    result.pruned_time = result.considered - result.pruned_memory - len(priced_orders)
    return fits


def _partitioned(request: PlanRequest, first: Priced, tick: Callable[[], None]) -> Priced:
    """`first` with the balanced (and, where cheap, the auto) partition when
    one fits and is faster (module doc, step 4)."""
    cfg = first.config
    spec = spec_for(model_at(request.model, cfg.mesh.ep), cfg, request.seq_len)
    pp = cfg.mesh.pp
    hardware = hardware_of(request)
    derived = derive_decoder(spec, hardware, pp)
    layered = layered_costs(spec, hardware, pp, derived.costs, derived.mem)
    sch = generate(cfg.schedule, pp, cfg.microbatches, **cfg.options())
    tries = {balanced_partition(layered, spec.layers, sch.num_stages)}
    if sch.num_stages * cfg.microbatches <= AUTO_PARTITION_WORK:
        tries.add(auto_partition(sch, layered, spec.layers).counts)
    best = first
    for counts in tries:
        tick()
        trial = priced(request, cfg, counts)
        if trial.peak_bytes <= request.budget and trial.step_s < best.step_s - 1e-12:
            best = trial
    return best


def plan(request: PlanRequest, progress: Progress | None = None) -> PlanResult:
    """The `request.top` fastest configurations that fit (module doc); NoPlan
    (one line: what would be needed) when none does. `progress` is called as
    the search goes (often: it should only look at the clock)."""
    t0 = time.perf_counter()
    tell = progress or _quiet
    result = PlanResult([], request)
    if next(iter(meshes(request)), None) is None:
        raise NoPlan(explain_no_mesh(request))
    fits = _search(request, result, tell)
    if result.considered == 0:
        raise NoPlan(f"--global-batch {request.global_batch}: every mesh's share needs more "
                     f"than {MAX_STAGE_MICROBATCHES} stages x microbatches at microbatch "
                     f"sizes up to {request.max_microbatch_size}; raise --max-microbatch-size")
    if not fits:
        raise NoPlan(explain_no_fit(request, result, plan))
    if request.partition == "auto":
        fits = [_partitioned(request, p, lambda: tell(result)) for p in fits]
    if request.tp_overlap:
        fits = [overlapped(request, p, lambda: tell(result)) for p in fits]
    result.plans = sorted(fits, key=lambda p: p.step_s)
    result.seconds = time.perf_counter() - t0
    return result


def priced_at(request: PlanRequest, mesh: Mesh, microbatch_size: int,
              schedule: str, chunks: int | None = None,
              partition: tuple[int, ...] | None = None) -> Priced | None:
    """One configuration priced as the planner prices it: the first rung of
    the lever ladder that fits the budget (None: none does), at `chunks` per
    rank and `partition` (layers per stage; None: the even split). For
    checking a published configuration against the planner's figures."""
    ladder = levers_for(request, mesh)
    per_replica = request.global_batch // mesh.dp
    base = Config(mesh, microbatch_size, per_replica // microbatch_size, schedule, ladder[0][1],
                  chunks)
    rung = _first_rung(request, base, ladder, 0)
    while rung is not None:
        got = priced(request, replace(base, features=ladder[rung][1]), partition)
        if got.peak_bytes <= request.budget:
            return got
        rung = _first_rung(request, base, ladder, rung + 1)
    return None
