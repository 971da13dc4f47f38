"""V-shape building blocks under a memory limit: the adaptive scheme of
"Pipeline Parallelism with Controllable Memory" (Qi, Wan, Amar, Lin,
NeurIPS 2024, arXiv 2405.15362, section 3.1 and Appendix A).

A V-shape block gives rank i four slots per microbatch, F and f (forwards of
its chunks 0 and 1, down then up the V) and B and b (backwards of chunks 1
and 0), plus two W, on the six residues of a period of 6. The paper builds
the family from rank 0's residues and *uniform offsets*: rank i+1's F and B
sit `delta` slots after rank i's (the pass has to travel one rank down),
its f and b one slot before (they travel up). The offsets of the first
`len_0` steps may differ from the rest (`delta_0 >= delta_1`), which tunes
the block's lifespan, hence its peak memory (lifespan / 6, `block_peak`),
between V-Min's (delta 1) and beyond ZB-V's. V-Half is rank 0's residues
(0, 3p-2, 3p-1+d, 6p+d-2) with delta 2 everywhere.

Absolute slots follow the V: each pass takes the first slot with its
residue after the pass it waits for (F of rank i after F of rank i-1, f of
rank p-1 after its F, f of rank i after f of rank i+1, then B down and b
up the same way), so every block respects the dependencies.

`candidates` ranks the blocks whose repeated peak fits the limit by the
bubble the paper expects of a V-shape block with peak `l` chunk
activations, `6p - 1 - 3l` slots (more memory, less bubble), and settles
them (`stp.schedule.building_block.settle`) best first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from stp.schedule.building_block import block_peak
from stp.schedule.gen_v import PERIOD, controllable_memory_block, from_offsets
from stp.schedule.ir import Kind, Schedule
from stp.schedule.memory import MemCosts, peak_by_order

__all__ = ["Offsets", "v_shape_offsets", "v_shape_family", "candidates"]

Offsets = tuple[tuple[int, int, int, int], ...]
"""Per rank, the slots of (F, f, B, b) of one microbatch."""

_EPS = 1e-9


def _next_with_residue(after: int, residue: int) -> int:
    """The first slot later than `after` whose residue mod 6 is `residue`."""
    return after + 1 + (residue - after - 1) % PERIOD


def v_shape_offsets(
    num_ranks: int, rank0: tuple[int, int, int], delta_0: int, delta_1: int, len_0: int
) -> Offsets | None:
    """The block of rank 0's residues (F at 0; f, B, b at `rank0`) and uniform
    offsets (`delta_0` for ranks 1..len_0, `delta_1` after); None when two of
    a rank's passes would share a residue."""
    p = num_ranks
    res = [(0, *rank0)]
    for i in range(1, p):
        d = delta_0 if i <= len_0 else delta_1
        f0, f1, b1, b0 = res[-1]
        nxt = ((f0 + d) % PERIOD, (f1 - 1) % PERIOD, (b1 + d) % PERIOD, (b0 - 1) % PERIOD)
        if len(set(nxt)) < 4:
            return None
        res.append(nxt)
    if len(set(res[0])) < 4:
        return None
    slot_f0, slot_f1, slot_b1, slot_b0 = [0] * p, [0] * p, [0] * p, [0] * p
    for i in range(1, p):
        slot_f0[i] = _next_with_residue(slot_f0[i - 1], res[i][0])
    slot_f1[p - 1] = _next_with_residue(slot_f0[p - 1], res[p - 1][1])
    for i in range(p - 2, -1, -1):
        slot_f1[i] = _next_with_residue(slot_f1[i + 1], res[i][1])
    slot_b1[0] = _next_with_residue(slot_f1[0], res[0][2])
    for i in range(1, p):
        slot_b1[i] = _next_with_residue(slot_b1[i - 1], res[i][2])
    slot_b0[p - 1] = _next_with_residue(slot_b1[p - 1], res[p - 1][3])
    for i in range(p - 2, -1, -1):
        slot_b0[i] = _next_with_residue(slot_b0[i + 1], res[i][3])
    return tuple(zip(slot_f0, slot_f1, slot_b1, slot_b0, strict=True))


def v_shape_family(num_ranks: int) -> list[Offsets]:
    """Every distinct block of the family (rank 0's residues, two offsets,
    the length of the first run), in enumeration order."""
    p = num_ranks
    seen: set[Offsets] = set()
    out: list[Offsets] = []
    others = range(1, PERIOD)
    for f1 in others:
        for b1 in others:
            for b0 in others:
                if len({f1, b1, b0}) < 3:
                    continue
                for d0 in range(1, PERIOD):
                    for d1 in range(1, d0 + 1):
                        for len_0 in range(1, max(2, p)):
                            offs = v_shape_offsets(p, (f1, b1, b0), d0, d1, len_0)
                            if offs is not None and offs not in seen:
                                seen.add(offs)
                                out.append(offs)
    return out


def _expected(num_ranks: int, offs: Offsets, mem: MemCosts) -> tuple[float, int]:
    """(peak in M_B under `mem` of the repeated block's steady state, the
    paper's expected bubble 6p - 1 - 3l in slots, l its peak until W)."""
    p = num_ranks
    block = controllable_memory_block(p, list(offs))
    until_b = max(block_peak(block, r, Kind.B) for r in range(p))
    until_w = max(block_peak(block, r, Kind.W) for r in range(p))
    # M_W of each activation is kept from B to W: between the two counts.
    peak = (until_b * (mem.m_b - mem.m_w) + until_w * mem.m_w) / 2
    return peak, max(0, 6 * p - 1 - 3 * until_w)


def candidates(
    num_ranks: int,
    num_microbatches: int,
    mem: MemCosts,
    limit: float,
    out_of_time: Callable[[], bool],
) -> Iterator[tuple[str, Schedule]]:
    """Settled V-shape schedules that fit `limit`, the most promising block
    first (least expected bubble, then most memory); stops when out of time."""
    p, m = num_ranks, num_microbatches
    ranked = []
    for offs in v_shape_family(p):
        if out_of_time():
            return
        peak, bubble = _expected(p, offs, mem)
        if min(peak, m * mem.m_b) <= limit + _EPS:
            ranked.append((bubble, -peak, offs))
    ranked.sort()
    for k, (bubble, _, offs) in enumerate(ranked):
        if out_of_time():
            return
        sch = from_offsets("v-block", p, m, list(offs))
        if max(peak_by_order(sch, mem)) <= limit + _EPS:
            yield f"v-shape block {k} (expected bubble {bubble})", sch
