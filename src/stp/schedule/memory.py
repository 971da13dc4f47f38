"""Activation-memory accounting shared by the validator and the simulator.

Units: one microbatch's activations for one rank's whole share of the model
(the papers' `M_B`). A rank holding `v` chunks keeps `M_B / v` per chunk.

"Zero Bubble Pipeline Parallelism" (arXiv 2401.10241, section 2) splits
what a microbatch keeps alive: `M_B` from its F until its B, and `M_W` of it
(the inputs W needs) until its W. So F adds `M_B/v`, B releases
`(M_B - M_W)/v`, W the remaining `M_W/v`, and a full backward BW releases
`M_B/v` at once.

Default `M_W = 0`: the published peak formulas (1F1B `p`, ZB-H2 `2p-1`,
V-Half `(p+2)//2`, V-Min `(p+4)//3`, STP `3p M_a`) count `M_B` only. Zero
Bubble's own estimates give `M_W / M_B = 32h / (34h + 5as)`, about 0.3 for
a GPT-3-like layer at s=2048; pass `MemCosts(m_b=1, m_w=0.3)` to see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from stp.schedule.ir import Action, Kind, Pass, Schedule, passes_of

__all__ = ["MemCosts", "pass_memory_delta", "action_memory", "peak_by_order"]


@dataclass(frozen=True)
class MemCosts:
    """Activation memory of one microbatch through one rank's share."""

    m_b: float = 1.0
    """M_B: kept from the forward until the input-gradient backward."""
    m_w: float = 0.0
    """M_W: the part of M_B still kept from B until W (must be <= M_B)."""

    def __post_init__(self) -> None:
        if not self.m_b >= 0:
            raise ValueError(f"memory b={self.m_b} must be >= 0")
        if not 0 <= self.m_w <= self.m_b:
            raise ValueError(f"memory w={self.m_w} must be between 0 and b={self.m_b}")


def pass_memory_delta(p: Pass, chunks: int, mem: MemCosts) -> float:
    """Signed change of resident activations when pass `p` completes (F: when it starts)."""
    if p.kind is Kind.F:
        return mem.m_b / chunks
    if p.kind is Kind.B:
        return -(mem.m_b - mem.m_w) / chunks
    if p.kind is Kind.W:
        return -mem.m_w / chunks
    return -mem.m_b / chunks  # BW


def action_memory(action: Action, chunks: int, mem: MemCosts) -> tuple[float, float]:
    """(allocated at the start, released at the end) by one action.

    Forwards allocate when the action starts, backwards release when it ends,
    so a braided block F+B counts both activations at its peak.
    """
    alloc = free = 0.0
    for p in passes_of(action):
        d = pass_memory_delta(p, chunks, mem)
        if d > 0:
            alloc += d
        else:
            free -= d
    return alloc, free


def peak_by_order(schedule: Schedule, mem: MemCosts | None = None) -> list[float]:
    """Peak resident activation per rank, from the action order alone (no time).

    Equals the simulator's peak: memory changes only at action boundaries.
    """
    mem = mem or MemCosts()
    v = schedule.chunks
    peaks = []
    for acts in schedule.actions:
        cur = peak = 0.0
        for a in acts:
            alloc, free = action_memory(a, v, mem)
            cur += alloc
            peak = max(peak, cur)
            cur -= free
        peaks.append(peak)
    return peaks
