"""Cut passes into units and braid the units of a block into one stream order.

A pass through one chunk is `U = 2 * layers` units (attention, MLP per layer;
STP seed 000 section 3, Fig. 2). Each F and B unit ends in a TP all-reduce;
W units have none. A chain is the sequence of steps one pass contributes to
the compute stream; a full backward BW contributes steps of (B unit, W unit)
so that the W of a unit runs while that unit's B all-reduce is in flight.

Braiding (STP Fig. 3) interleaves the chains of a block: at each step the
chain that has made the least relative progress goes next (ties: the order in
the block, forward first). For F with BW this gives the paper's order

    Attn(F) | MLP B | MLP W | MLP(F) | Attn B | Attn W
      AR(F)---^         ^-- AR(B) runs under W

and for F with two deferred W it fills each F all-reduce with two W units.
"""

from __future__ import annotations

from dataclasses import dataclass

from stp.schedule.ir import Action, Kind, Pass, passes_of

__all__ = ["Item", "braid", "braid_counts"]


@dataclass(frozen=True, slots=True)
class Item:
    """One unit of compute on the stream, in execution order within an action."""

    chain: int
    """Index of the pass within its action."""
    kind: str
    """'F', 'B' or 'W'."""
    unit: int
    """Unit index in forward order (0 = first attention unit of the chunk)."""
    first: bool
    """First item of its chain: waits for the pass's input to arrive."""
    has_ar: bool
    """Ends in a TP all-reduce (F and B units)."""
    waits_ar: bool
    """Waits for the all-reduce of the chain's previous F/B unit."""


def _chain_steps(p: Pass, chain: int, units: int) -> list[list[Item]]:
    U = units
    if p.kind is Kind.F:
        return [[Item(chain, "F", u, u == 0, True, u > 0)] for u in range(U)]
    if p.kind is Kind.W:
        down = enumerate(range(U - 1, -1, -1))
        return [[Item(chain, "W", u, k == 0, False, False)] for k, u in down]
    steps = []
    for k, u in enumerate(range(U - 1, -1, -1)):
        step = [Item(chain, "B", u, k == 0, True, k > 0)]
        if p.kind is Kind.BW:
            step.append(Item(chain, "W", u, False, False, False))
        steps.append(step)
    return steps


_CACHE: dict[tuple[tuple[Kind, ...], tuple[int, ...]], tuple[Item, ...]] = {}


def braid(action: Action, units: int) -> tuple[Item, ...]:
    """The items of `action` in stream order (a lone pass: its own order)."""
    return braid_counts(action, (units,) * len(passes_of(action)))


def braid_counts(action: Action, counts: tuple[int, ...]) -> tuple[Item, ...]:
    """As `braid`, with `counts[c]` units for pass c (the runtime's first and
    last stages hold extra units: embedding, loss)."""
    ps = passes_of(action)
    if len(counts) != len(ps):
        raise ValueError(f"{action}: {len(ps)} passes but {len(counts)} unit counts")
    key = (tuple(p.kind for p in ps), tuple(counts))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    chains = [_chain_steps(p, c, n) for c, (p, n) in enumerate(zip(ps, counts, strict=True))]
    pos = [0] * len(chains)
    order: list[Item] = []
    while True:
        # least relative progress first: pos[c]/len(c) smallest, compared exactly
        best = -1
        for c, steps in enumerate(chains):
            if pos[c] < len(steps) and (
                best < 0 or pos[c] * len(chains[best]) < pos[best] * len(steps)
            ):
                best = c
        if best < 0:
            break
        order.extend(chains[best][pos[best]])
        pos[best] += 1
    out = tuple(order)
    _CACHE[key] = out
    return out
