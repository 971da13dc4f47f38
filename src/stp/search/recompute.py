"""Choose activation recomputation per stage when a memory limit demands it.

Recomputation trades B time for activation bytes (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, section 5; the formulas in `stp.costmodel.decoder.spec`). Given a
decoder and a limit in units of its M_B *without* recomputation, the search
runs once per mode (none, selective, full) that can meet the limit at all,
with every stage's memory expressed in that one unit, and keeps the fastest
schedule that fits. A post-pass then takes each stage back to a cheaper
mode, one stage at a time, while the found order still fits and gets
faster: the first stage, with the embedding, and the last, with the output
layer, may need more than the middle ones. The modes chosen per stage are
reported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from stp.costmodel.decoder.costs import derive_decoder
from stp.costmodel.decoder.spec import RECOMPUTE_MODES, ModelSpec
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.stages import layered_costs
from stp.schedule.memory import MemCosts
from stp.search.entry import SearchResult, search
from stp.sim.engine import simulate
from stp.sim.layered import LayeredCosts, even_partition
from stp.sim.stages import StageCost, StageCosts

__all__ = ["RecomputeChoice", "mode_costs", "search_recompute"]

_EPS = 1e-9


@dataclass(frozen=True)
class RecomputeChoice:
    """What `search_recompute` found."""

    result: SearchResult
    modes: tuple[str, ...]
    """The recomputation of each global stage of the found schedule."""
    tried: dict[str, float | None]
    """Each mode's best makespan with every stage in it (None: cannot fit)."""

    def to_json(self) -> dict[str, object]:
        return {"recompute": list(self.modes), "recompute_tried": dict(self.tried)}


def _scaled(c: StageCost, k: float) -> StageCost:
    return replace(c, mem_b=c.mem_b * k, mem_w=c.mem_w * k)


def mode_costs(model: ModelSpec, hardware: HardwareSpec, pp: int,
               layers: int = 1) -> dict[str, tuple[LayeredCosts, MemCosts]]:
    """Per mode, the per-layer costs and the uniform memory of one rank's share,
    all in units of the model's M_B without recomputation."""
    unit = derive_decoder(replace(model, recompute="none"), hardware, pp).bytes_per_unit
    out = {}
    for mode in RECOMPUTE_MODES:
        spec = replace(model, recompute=mode)
        d = derive_decoder(spec, hardware, pp)
        k = d.bytes_per_unit / unit
        lc = layered_costs(spec, hardware, pp, d.costs, d.mem, layers)
        lc = replace(lc, layer=_scaled(lc.layer, k), first=_scaled(lc.first, k),
                     last=_scaled(lc.last, k))
        out[mode] = (lc, MemCosts(m_b=d.mem.m_b * k, m_w=d.mem.m_w * k))
    return out


def _even_table(lc: LayeredCosts, layers: int, num_stages: int) -> StageCosts:
    """`lc`'s cost table with `layers` cut evenly into `num_stages` stages."""
    return lc.table(even_partition(layers, num_stages))


def search_recompute(model: ModelSpec, hardware: HardwareSpec, pp: int, m: int, *,
                     memory_limit: float, time_limit: float = 20.0, layers: int = 1,
                     **options: Any) -> RecomputeChoice:
    """The fastest schedule within `memory_limit` (units of M_B without
    recomputation) over the recomputation modes, then per stage (module doc).
    ValueError when even full recomputation cannot meet the limit."""
    costs_by_mode = mode_costs(model, hardware, pp, layers)
    feasible = [mode for mode, (_, mem) in costs_by_mode.items()
                if memory_limit >= mem.m_b - _EPS]
    if not feasible:
        need = costs_by_mode["full"][1].m_b
        raise ValueError(f"memory limit {memory_limit:g} is below what full recomputation "
                         f"needs, {need:g} M_B (one microbatch's layer inputs)")
    tried: dict[str, float | None] = dict.fromkeys(RECOMPUTE_MODES)
    best: tuple[str, SearchResult] | None = None
    refusal = ""
    for mode in feasible:
        lc, mem = costs_by_mode[mode]
        d = derive_decoder(replace(model, recompute=mode), hardware, pp)
        try:
            res = search(pp, m, d.costs, mem, memory_limit=memory_limit,
                         time_limit=time_limit / len(feasible), layers=layers,
                         stage_costs=partial(_even_table, lc, model.layers),
                         **options)
        except ValueError as e:  # the first or last stage's extras do not fit
            refusal = str(e)
            continue
        tried[mode] = res.result.makespan
        if best is None or res.result.makespan < best[1].result.makespan - _EPS:
            best = (mode, res)
    if best is None:
        raise ValueError(f"{refusal} (with full recomputation too)")
    mode, res = best
    modes = _per_stage(res, mode, costs_by_mode, memory_limit, model.layers)
    return RecomputeChoice(res, modes, tried)


def _per_stage(res: SearchResult, chosen: str, costs_by_mode: dict, limit: float,
               num_layers: int) -> tuple[str, ...]:
    """Take stages back to cheaper modes one at a time while the found order
    still fits `limit` and gets faster; `res.result` becomes the final run."""
    sch = res.schedule
    counts = even_partition(num_layers, sch.num_stages)
    tables = {mode: lc.table(counts) for mode, (lc, _) in costs_by_mode.items()}
    modes = [chosen] * sch.num_stages
    cheaper = RECOMPUTE_MODES[:RECOMPUTE_MODES.index(chosen)]
    current = res.result
    for stage in range(sch.num_stages):
        for mode in cheaper:
            trial = modes.copy()
            trial[stage] = mode
            table = StageCosts(tuple(tables[md].stages[s] for s, md in enumerate(trial)),
                               tables[chosen].comm, tuple(counts))
            run = simulate(sch, current.costs, current.mem, layers=current.layers,
                           record_spans=False, stages=table)
            if max(run.peak_activation) <= limit + _EPS and run.makespan < current.makespan:
                modes, current = trial, run
                break
    res.result = current
    return tuple(modes)
