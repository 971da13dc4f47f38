"""Cut passes into units and braid the units of a block into one stream order.

A pass through one chunk is `U = 2 * layers` units: per layer an attention
unit and an MLP unit, cut at the layer's two TP all-reduces ("Synergistic
Tensor and Pipeline Parallelism", arXiv 2510.27257, section 3, Fig. 2). Each
F and B unit ends in a TP all-reduce; W units have none. A chain is the
sequence of steps one pass contributes to the compute stream; a full backward
BW contributes steps of (B unit, W unit) so that the W of a unit runs while
that unit's B all-reduce is in flight.

Braiding (same paper, Fig. 3) interleaves the chains of a block: at each step
the chain that has made the least relative progress goes next (ties: the
order in the block, forward first). For F with BW this gives the paper's order

    Attn(F) | MLP B | MLP W | MLP(F) | Attn B | Attn W
      AR(F)---^         ^-- AR(B) runs under W

and for F with two deferred W it fills each F all-reduce with two W units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from stp.schedule.ir import Action, Kind, Pass, passes_of

__all__ = ["UnitKind", "Item", "braid", "braid_counts", "sequential_order"]


class UnitKind(StrEnum):
    """What a unit computes a piece of: the forward output (F), the input
    gradient (B) or the weight gradient (W), the kinds a `Done` key takes. A
    full backward (`Kind.BW`) is cut into B units and W units, so no unit is
    BW. The values are the `Kind` labels, not PyTorch's codes (`Kind.B` is
    "I"): spans, traces and pictures name a B unit "B"."""

    F = "F"
    B = "B"
    W = "W"


@dataclass(frozen=True, slots=True)
class Item:
    """One unit of compute on the stream, in execution order within an action."""

    chain: int
    """Index of the pass within its action."""
    kind: UnitKind
    """F, B or W: which result this unit computes a piece of."""
    unit: int
    """Unit index in forward order (0 = first attention unit of the chunk)."""
    first: bool
    """First item of its chain: waits for the pass's input to arrive."""
    has_ar: bool
    """Ends in a TP all-reduce (F and B units)."""
    waits_ar: bool
    """Waits for the all-reduce of the chain's previous F/B unit."""


def _chain_steps(p: Pass, chain: int, units: int) -> list[list[Item]]:
    """Pass p's steps in its own order: F units forward (0..U-1); B and W units
    backward (U-1..0); a full backward steps (B unit, W unit) together."""
    down = list(enumerate(range(units - 1, -1, -1)))
    if p.kind is Kind.F:
        return [[Item(chain, UnitKind.F, u, u == 0, True, u > 0)] for u in range(units)]
    if p.kind is Kind.W:
        return [[Item(chain, UnitKind.W, u, k == 0, False, False)] for k, u in down]
    steps = [[Item(chain, UnitKind.B, u, k == 0, True, k > 0)] for k, u in down]
    if p.kind is Kind.BW:
        for step, (_, u) in zip(steps, down, strict=True):
            step.append(Item(chain, UnitKind.W, u, False, False, False))
    return steps


_CacheKey = tuple[object, ...]
"""(braided, unit counts, the passes' kinds...)"""
_CACHE: dict[_CacheKey, tuple[Item, ...]] = {}


def braid(action: Action, units: int) -> tuple[Item, ...]:
    """The items of `action` in stream order (a lone pass: its own order)."""
    return braid_counts(action, (units,) * len(passes_of(action)))


def braid_counts(action: Action, counts: Sequence[int]) -> tuple[Item, ...]:
    """As `braid`, with `counts[c]` units for pass c (the runtime's first and
    last stages hold extra units: embedding, loss)."""
    return _ordered(action, counts, braided=True)


def sequential_order(action: Action, counts: Sequence[int]) -> tuple[Item, ...]:
    """The unbraided order of `action`: pass after pass, each with its own
    chain's items; a full backward runs all its B units, then all its W units
    (as a model stage's plain full backward does). The runtime's baseline."""
    return _ordered(action, counts, braided=False)


def _ordered(action: Action, counts: Sequence[int], *, braided: bool) -> tuple[Item, ...]:
    ps = passes_of(action)
    if len(counts) != len(ps):
        raise ValueError(f"{action}: {len(ps)} passes but {len(counts)} unit counts")
    key = (braided, tuple(counts), *[p.kind for p in ps])
    hit = _CACHE.get(key)
    if hit is None:
        chains = [_chain_steps(p, c, n) for c, (p, n) in enumerate(zip(ps, counts, strict=True))]
        hit = _CACHE[key] = tuple(_braided(chains) if braided else _pass_by_pass(chains))
    return hit


def _braided(chains: list[list[list[Item]]]) -> list[Item]:
    """Least relative progress first: the chain with the smallest pos[c]/len(c)
    (compared exactly, by cross-multiplying) takes its next step."""
    pos = [0] * len(chains)
    order: list[Item] = []
    while True:
        best = -1
        for c, steps in enumerate(chains):
            if pos[c] < len(steps) and (
                best < 0 or pos[c] * len(chains[best]) < pos[best] * len(steps)
            ):
                best = c
        if best < 0:
            return order
        order.extend(chains[best][pos[best]])
        pos[best] += 1


def _pass_by_pass(chains: list[list[list[Item]]]) -> list[Item]:
    """Each chain in turn; within a chain the first item of every step (its F,
    B or W units in order), then the second (a full backward's W units)."""
    order: list[Item] = []
    for steps in chains:
        order += [step[0] for step in steps]
        order += [step[1] for step in steps if len(step) > 1]
    return order
