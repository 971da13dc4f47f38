"""The TP overlap mode of a schedule: none, braided, in-layer or both, and K.

A searched (or handcrafted) schedule is an order of actions; how its TP
collectives are overlapped is a separate choice that changes the step but
not the order (`stp.sim.inlayer`): braided blocks braided or run pass by
pass, and the passes that run alone chunked into K pieces or not. `modes`
simulates every choice that changes something on the schedule, `fastest`
picks one; `stp search --tp-overlap` reports them for the schedule it found,
`stp plan` makes the same choice for its top plans (`stp.plan.overlap`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stp.schedule.ir import Block, Schedule
from stp.sim.costs import Costs, MemCosts
from stp.sim.engine import simulate
from stp.sim.inlayer import InLayer
from stp.sim.result import SimResult
from stp.sim.stages import StageCosts

__all__ = ["modes", "fastest", "has_blocks", "CHUNK_CHOICES"]

CHUNK_CHOICES = (2, 4, 8)


def has_blocks(schedule: Schedule) -> bool:
    """Whether any action braids several passes (else braiding changes nothing)."""
    return any(isinstance(a, Block) for acts in schedule.actions for a in acts)


def modes(schedule: Schedule, costs: Costs, mem: MemCosts, layers: int = 1, *,
          stages: StageCosts | None = None,
          plan_for: Callable[[int], InLayer] = InLayer,
          chunks: Sequence[int] = CHUNK_CHOICES) -> list[SimResult]:
    """The schedule simulated in every overlap mode that changes something:
    braided (as given), none (blocks pass by pass) where it has blocks, and for
    each K of `chunks` both (lone passes chunked) and, where it has blocks,
    in-layer (every pass chunked). `plan_for(K)` prices K chunks (default: free)."""
    blocks = has_blocks(schedule)
    choices: list[tuple[bool, InLayer | None]] = [(True, None)]
    if blocks:
        choices.append((False, None))
    for k in chunks:
        plan = plan_for(k)
        choices.append((True, plan))
        if blocks:
            choices.append((False, plan))
    return [simulate(schedule, costs, mem, layers, record_spans=False, stages=stages,
                     braid=braid, in_layer=plan) for braid, plan in choices]


def fastest(results: Sequence[SimResult]) -> SimResult:
    """The shortest step; on a tie the first (braided, then fewer chunks)."""
    return min(results, key=lambda r: r.makespan)
