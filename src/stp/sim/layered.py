"""Per-stage costs of a model cut into layers: a layer partition turned into a
`StageCosts` table.

A stage holding `L` transformer layers costs `L` times one layer's pass, and
the first and last stages add what only they hold (the embedding; the final
norm, the output layer and the loss: `stp.costmodel.stages` derives these
from a model). `LayeredCosts.from_rank_share` reads one layer's costs off
the uniform shorthand, whose times are for one rank's share of
`num_layers / num_ranks` layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stp.schedule.memory import MemCosts
from stp.schedule.placement import partition_layers
from stp.sim.costs import Costs
from stp.sim.stages import StageCost, StageCosts

__all__ = ["LayeredCosts", "Partition", "check_partition", "even_partition", "parse_partition"]

_ZERO = StageCost(0.0, 0.0, 0.0)
MAX_PARTITION_STAGES = 1024
Partition = str | tuple[int, ...]
"""`auto` or explicit layer counts per global stage."""


def parse_partition(text: str) -> Partition:
    """`auto` or `L0,L1,...` (ASCII integers); ValueError naming the value."""
    raw = text.strip()
    if raw == "auto":
        return "auto"
    shown = raw[:60]
    if not raw.isascii():
        raise ValueError(f"--partition {ascii(shown)}: give auto or ASCII layer counts L0,L1,..")
    items = [x.strip() for x in raw.split(",")]
    if len(items) > MAX_PARTITION_STAGES:
        raise ValueError(f"--partition names {len(items)} stages; at most "
                         f"{MAX_PARTITION_STAGES}")
    if not all(x.isdigit() and len(x) <= 6 for x in items):
        raise ValueError(f"--partition {shown!r}: give auto or layer counts L0,L1,.. "
                         "(integers >= 1, one per global stage)")
    return tuple(int(x) for x in items)


def even_partition(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """The even split (`stp.schedule.placement.partition_layers`: the first
    `num_layers % num_stages` stages hold one extra layer)."""
    return tuple(len(r) for r in partition_layers(num_layers, num_stages))


def check_partition(counts: Sequence[int], num_stages: int, num_layers: int | None,
                    flag: str = "--partition") -> tuple[int, ...]:
    """`counts` as a tuple, or a one-line ValueError naming the value: one
    entry per global stage of the schedule, each >= 1, summing to the model's
    `num_layers` when that is known."""
    counts = tuple(counts)
    shown = ",".join(map(str, counts))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if len(counts) != num_stages:
        raise ValueError(f"{flag} {shown} names {len(counts)} stages but the schedule has "
                         f"{num_stages} global stages; give one layer count per stage")
    for s, c in enumerate(counts):
        if c < 1:
            raise ValueError(f"{flag} {shown}: stage {s} has {c} layers; every stage of the "
                             "schedule runs passes and needs at least one layer")
    if num_layers is not None and sum(counts) != num_layers:
        raise ValueError(f"{flag} {shown} sums to {sum(counts)} layers but the model has "
                         f"{num_layers}; the stages must hold every layer once")
    return counts


def _add(a: StageCost, b: StageCost, units: int) -> StageCost:
    ar_b = None if a.ar_b is None and b.ar_b is None else a.ar_backward + b.ar_backward
    return StageCost(a.f + b.f, a.b + b.b, a.w + b.w, a.ar + b.ar, ar_b,
                     a.mem_b + b.mem_b, a.mem_w + b.mem_w, units, a.ag + b.ag, a.rs + b.rs,
                     a.a2a + b.a2a)


def _scale(c: StageCost, k: int) -> StageCost:
    ar_b = None if c.ar_b is None else c.ar_b * k
    return StageCost(c.f * k, c.b * k, c.w * k, c.ar * k, ar_b, c.mem_b * k, c.mem_w * k,
                     c.units, c.ag * k, c.rs * k, c.a2a * k)


@dataclass(frozen=True)
class LayeredCosts:
    """One layer's pass, the extras of the first and last stage, and how the
    simulator cuts a stage's pass into units."""

    layer: StageCost
    """One transformer layer: times and memory of one microbatch's pass."""
    first: StageCost = _ZERO
    """Added to stage 0 (the embedding)."""
    last: StageCost = _ZERO
    """Added to the last stage (final norm, output layer, loss)."""
    comm: float = 0.0
    units: int = 2
    """Units of every stage's pass (`--layers` gives two per layer)."""
    num_layers: int | None = None
    """The model's layers, when known: a partition must sum to it."""

    @classmethod
    def from_rank_share(cls, costs: Costs, mem: MemCosts, num_ranks: int, num_layers: int, *,
                        layers: int = 1, first: StageCost = _ZERO, last: StageCost = _ZERO,
                        known_layers: bool = True) -> LayeredCosts:
        """From the uniform costs of one rank's share of `num_layers /
        num_ranks` layers. `known_layers`: partitions must sum to `num_layers`."""
        k = num_ranks / num_layers
        ar = costs.ar * k
        layer = StageCost(costs.f * k, costs.b * k, costs.w * k, ar, None, mem.m_b * k,
                          mem.m_w * k, 2, costs.ag * k, costs.rs * k, costs.a2a * k)
        return cls(layer, first, last, costs.comm, 2 * layers,
                   num_layers if known_layers else None)

    def stage(self, index: int, num_stages: int, layers: int) -> StageCost:
        """Stage `index` of `num_stages` holding `layers` layers."""
        out = _scale(self.layer, layers)
        if index == 0:
            out = _add(out, self.first, self.units)
        if index == num_stages - 1:
            out = _add(out, self.last, self.units)
        return StageCost(out.f, out.b, out.w, out.ar, out.ar_b, out.mem_b, out.mem_w,
                         self.units, out.ag, out.rs, out.a2a)

    def table(self, counts: Sequence[int]) -> StageCosts:
        """The cost table of the partition `counts` (layers per global stage)."""
        n = len(counts)
        return StageCosts(tuple(self.stage(s, n, c) for s, c in enumerate(counts)), self.comm,
                          tuple(counts))

    def stage_time(self, index: int, num_stages: int, layers: int) -> float:
        """Compute (f + b + w) of one microbatch through the stage."""
        t = self.layer.compute * layers
        if index == 0:
            t += self.first.compute
        if index == num_stages - 1:
            t += self.last.compute
        return t
