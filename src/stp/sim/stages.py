"""Per-stage costs: each global stage's own pass times and activation memory.

Real pipelines are not uniform: the first stage also holds the embedding, the
last the output layer and the loss (with a large vocabulary it costs as much
as several layers), and a layer partition may give stages different numbers
of layers. A `StageCosts` table gives every global stage (a model chunk,
`Schedule.num_stages` of them) its own times of one microbatch's pass and its
own activation memory; the simulator reads it in place of the uniform
`Costs` shorthand.

Units, as the uniform costs'. Times: any unit (the `--cost` one). Memory:
units of M_B, one microbatch's activations through one rank's share of the
model, so that memory limits keep their meaning. The uniform shorthand with
`v` chunks per rank is the table whose every stage has `f/v, b/v, w/v, ar/v`
and memory `M_B/v, M_W/v` (`StageCosts.uniform`).

File format (`stp simulate --stage-costs FILE.json`, what `stp costs` writes):

    {"stages": [{"f": 1.2, "b": 1.3, "w": 0.9, "ar": 0.1, "ar_b": 0.1,
                 "mem_b": 0.5, "mem_w": 0.1, "units": 2}, ...],
     "comm": 0.05, "partition": [3, 4, 4, 3]}

one object per global stage in stage order; `f`, `b`, `w` are required,
`ar` (TP all-reduce time of the F pass), `ar_b` (of the B pass; default
`ar`), `mem_b`, `mem_w` (default 0), `units` (pieces of the pass, each
F/B unit ending in an all-reduce; default 2), with sequence
parallelism `ag` / `rs` (all-gather / reduce-scatter time of one F or B
pass; default 0) and with expert parallelism `a2a` (the all-to-alls of one
F or B pass; default 0) optional. `comm` (point-to-point
latency) and `partition` (layers per stage, for reports) are optional.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stp.files import read_json
from stp.schedule.memory import MemCosts
from stp.sim.costs import Costs

__all__ = ["StageCost", "StageCosts", "StageCostsFor", "load_stage_costs", "MAX_TABLE_BYTES"]

MAX_TABLE_BYTES = 4 << 20
"""Largest stage-cost file read (4 MiB: far more than 1024 stages need)."""
_MAX_UNITS = 128
_MAX_VALUE = 1e12
_KEYS = ("f", "b", "w", "ar", "ar_b", "mem_b", "mem_w", "units", "ag", "rs", "a2a")
_NUMBER_KEYS = tuple(k for k in _KEYS if k != "units")


def _number(val: object, what: str) -> float:
    if isinstance(val, bool) or not isinstance(val, int | float):
        raise ValueError(f"{what}={val!r} is not a number")
    if not (math.isfinite(val) and 0 <= val <= _MAX_VALUE):
        raise ValueError(f"{what}={val!r}: accepted are finite numbers 0..{_MAX_VALUE:g}")
    return float(val)


@dataclass(frozen=True)
class StageCost:
    """One global stage: times of one microbatch's pass through it, and the
    activations that pass keeps."""

    f: float
    """Forward compute."""
    b: float
    """Input-gradient backward compute."""
    w: float
    """Weight-gradient backward compute."""
    ar: float = 0.0
    """TP all-reduce time of the F pass, all its units together."""
    ar_b: float | None = None
    """TP all-reduce time of the B pass; None: the same as `ar` (a layer's two
    all-reduces have a backward twin each; the embedding reduces only in F,
    the vocab-parallel output layer mostly in B)."""
    mem_b: float = 0.0
    """Activations kept from F until B (units of M_B)."""
    mem_w: float = 0.0
    """Activations kept from B until W: usually the part of `mem_b` B leaves; more than
    `mem_b` when B allocates the rest (full recomputation with W deferred: B rebuilds
    the unit and W keeps its matrices' inputs and output gradients, more than the unit
    input F kept; stp.costmodel.decoder.kept)."""
    units: int = 2
    """Pieces the pass is cut into, each F/B piece ending in an all-reduce
    (`stp.sim.units`): two per transformer layer at the finest."""
    ag: float = 0.0
    """Sequence parallelism: all-gather time of one F or B pass, all units
    together (each F/B unit starts with one; `stp.sim.engine`)."""
    rs: float = 0.0
    """Sequence parallelism: reduce-scatter time of one F or B pass (each F/B
    unit ends with one)."""
    a2a: float = 0.0
    """Expert parallelism: all-to-all time of one F or B pass (dispatch and
    combine of every MoE layer; each F/B unit ends with one, `stp.sim.engine`)."""

    def __post_init__(self) -> None:
        for key in ("f", "b", "w", "ar", "mem_b", "mem_w", "ag", "rs", "a2a"):
            _number(getattr(self, key), key)
        if self.ar_b is not None:
            _number(self.ar_b, "ar_b")
        if isinstance(self.units, bool) or not isinstance(self.units, int) or not (
                1 <= self.units <= _MAX_UNITS):
            raise ValueError(f"units={self.units!r} must be an integer in 1..{_MAX_UNITS}")

    @property
    def ar_backward(self) -> float:
        return self.ar if self.ar_b is None else self.ar_b

    @property
    def compute(self) -> float:
        return self.f + self.b + self.w

    def to_json(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"f": self.f, "b": self.b, "w": self.w, "ar": self.ar}
        if self.ar_b is not None:
            out["ar_b"] = self.ar_b
        out.update(mem_b=self.mem_b, mem_w=self.mem_w, units=self.units)
        if self.ag or self.rs:
            out.update(ag=self.ag, rs=self.rs)
        if self.a2a:
            out["a2a"] = self.a2a
        return out

    @classmethod
    def from_json(cls, obj: object, where: str) -> StageCost:
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}: a stage is an object of {', '.join(_KEYS)}")
        unknown = sorted(set(obj) - set(_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(_KEYS)}")
        missing = [k for k in ("f", "b", "w") if k not in obj]
        if missing:
            raise ValueError(f"{where}: {', '.join(missing)} missing (f, b, w are required)")
        vals = {k: _number(obj[k], f"{where} {k}") for k in _NUMBER_KEYS if k in obj}
        units = obj.get("units", 2)
        try:
            return cls(**vals, units=units)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


@dataclass(frozen=True)
class StageCosts:
    """The cost table of a pipeline: one `StageCost` per global stage, in
    stage order, and the point-to-point latency between ranks."""

    stages: tuple[StageCost, ...]
    comm: float = 0.0
    """Latency of one activation or gradient send between ranks."""
    partition: tuple[int, ...] | None = None
    """Transformer layers of each stage, when the table came from a layer
    partition (reported; the times already include it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages or not all(isinstance(s, StageCost) for s in self.stages):
            raise ValueError("a stage cost table needs one StageCost per global stage")
        _number(self.comm, "comm")
        if sum(s.compute for s in self.stages) <= 0:
            raise ValueError("every stage's f, b, w are zero; at least one must be > 0")
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))
            if len(self.partition) != len(self.stages):
                raise ValueError(f"partition {self.partition} names {len(self.partition)} "
                                 f"stages, the table has {len(self.stages)}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def uniform(cls, costs: Costs, mem: MemCosts, num_stages: int, chunks: int,
                layers: int = 1) -> StageCosts:
        """The uniform shorthand as a table: every stage runs 1/`chunks` of a
        rank share's costs and keeps 1/`chunks` of its memory."""
        v = chunks
        one = StageCost(costs.f / v, costs.b / v, costs.w / v, costs.ar / v, None,
                        mem.m_b / v, mem.m_w / v, 2 * layers, costs.ag / v, costs.rs / v,
                        costs.a2a / v)
        return cls((one,) * num_stages, costs.comm)

    def check_fits(self, num_stages: int, where: str = "the stage cost table") -> None:
        """ValueError unless the table has exactly `num_stages` stages."""
        if self.num_stages != num_stages:
            raise ValueError(f"{where} has {self.num_stages} stages but the schedule has "
                             f"{num_stages} global stages; give one entry per stage")

    def rank_costs(self, stage_to_rank: Sequence[int]) -> list[float]:
        """Compute (f + b + w) of one microbatch through each rank's stages."""
        out = [0.0] * (max(stage_to_rank) + 1)
        for s, r in enumerate(stage_to_rank):
            out[r] += self.stages[s].compute
        return out

    def bounding_mem(self, chunks: int) -> MemCosts:
        """Uniform memory that no stage exceeds (`chunks` per rank): a schedule
        within a limit under it is within the limit under this table."""
        m_b = chunks * max(s.mem_b for s in self.stages)
        m_w = chunks * max(s.mem_w for s in self.stages)
        return MemCosts(m_b=m_b, m_w=min(m_w, m_b))

    def mean_costs(self, num_ranks: int) -> Costs:
        """Uniform costs of the average rank share (what reports and the
        search's construction heuristics read)."""
        n = num_ranks
        return Costs(
            f=sum(s.f for s in self.stages) / n, b=sum(s.b for s in self.stages) / n,
            w=sum(s.w for s in self.stages) / n,
            ar=sum((s.ar + s.ar_backward) / 2 for s in self.stages) / n, comm=self.comm,
            ag=sum(s.ag for s in self.stages) / n, rs=sum(s.rs for s in self.stages) / n,
            a2a=sum(s.a2a for s in self.stages) / n,
        )

    def mean_mem(self, num_ranks: int) -> MemCosts:
        """Memory of the average rank share."""
        m_b = sum(s.mem_b for s in self.stages) / num_ranks
        return MemCosts(m_b=m_b, m_w=min(m_b, sum(s.mem_w for s in self.stages) / num_ranks))

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"stages": [s.to_json() for s in self.stages],
                                  "comm": self.comm}
        if self.partition is not None:
            out["partition"] = list(self.partition)
        return out

    @classmethod
    def from_json(cls, obj: object, where: str = "stage costs") -> StageCosts:
        if not isinstance(obj, Mapping) or not isinstance(obj.get("stages"), list):
            raise ValueError(f"{where}: expected an object with a \"stages\" list")
        unknown = sorted(set(obj) - {"stages", "comm", "partition", "source"})
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; accepted: stages, comm, "
                             "partition, source")
        rows = obj["stages"]
        if not 1 <= len(rows) <= 1024:
            raise ValueError(f"{where}: {len(rows)} stages; give 1 to 1024")
        stages = tuple(StageCost.from_json(s, f"{where} stage {i}") for i, s in enumerate(rows))
        part = obj.get("partition")
        if part is not None and (not isinstance(part, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in part)):
            raise ValueError(f"{where}: partition must be a list of layer counts")
        try:
            return cls(stages, _number(obj.get("comm", 0.0), f"{where} comm"),
                       None if part is None else tuple(part))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


StageCostsFor = Callable[[int], StageCosts]
"""The per-stage table of a pipeline of n global stages (ValueError: none
fits n); what the search takes, as its placements differ in stage count."""


def load_stage_costs(path: str | Path) -> StageCosts:
    """Read a stage cost table (format in the module doc); ValueError naming
    the file and what is wrong."""
    obj = read_json(path, MAX_TABLE_BYTES)
    return StageCosts.from_json(obj, str(path))
