"""What the search may choose: placement, backward split, braiding, and the
knobs of the greedy list scheduler (`stp.search.greedy`).

The knobs generalise the boolean strategy flags of the Zero Bubble heuristic
("Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024, arXiv 2401.10241,
section 3.1: "we perform a grid search to find the best combination of
hyperparameters"): which ready pass a free rank runs first, when a
weight-gradient pass W may fill a gap, whether a forward may delay a
backward about to arrive, and (STP, arXiv 2510.27257) which passes are
braided into one block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stp.schedule.ir import looped_placement, v_placement
from stp.sim.costs import Costs

__all__ = ["Policy", "policies", "placement", "warmup_caps", "PLACEMENTS"]

PLACEMENTS = ("looped", "v")


@dataclass(frozen=True)
class Policy:
    """How the greedy list scheduler picks a free rank's next action."""

    split: bool = True
    """Backward as B then W later (Zero Bubble); False: full backwards BW."""
    prefer_b: bool = True
    """When a forward and a backward are both ready, run the backward first."""
    eager_w: bool = False
    """Run a pending W whenever nothing else is ready; False: only into a gap
    it fits (or to free memory for a forward), as Zero Bubble's heuristic."""
    w_now: bool = False
    """Run each W right after its B (a full backward whose input gradient
    leaves before its weight gradient is computed: ZB-V's F-B-W groups)."""
    deep_first: bool = True
    """Among ready forwards, the later stage first (finish microbatches in
    flight); False: the oldest microbatch first."""
    guard_f: bool = False
    """Do not start a forward that would delay a backward, or a deeper forward,
    arriving before it ends: run a W into the gap if it fits, else wait (after
    Zero Bubble's "skip one F if it doesn't cause more bubbles")."""
    braid: bool = False
    """Form braided blocks (STP): F with B, F with W, F with F."""
    braid_defer_w: bool = True
    """In an F+B block defer the W (later braided with a lone F); False: F+BW."""
    tight: bool = False
    """Two chunks: admit a microbatch into the last free memory while a
    second-chunk activation is alive (its backward will free memory), as
    ZB-V's steady state does; False keeps one chunk of headroom, which is
    deadlock-free by construction. A build that gets stuck is discarded."""
    cap: tuple[int, ...] | None = None
    """Most microbatches in flight per rank (admitted, first backward not done);
    None: only the memory limit bounds them."""

    def label(self) -> str:
        flags = [
            "split" if self.split else "full-bw",
            "B-first" if self.prefer_b else "F-first",
            "eager-W" if self.eager_w else "fit-W",
        ]
        if self.w_now:
            flags[2] = "W-after-B"
        if not self.deep_first:
            flags.append("oldest-F")
        if self.guard_f:
            flags.append("guard-F")
        if self.braid:
            flags.append("braid" + ("-deferW" if self.braid_defer_w else "-BW"))
        if self.tight:
            flags.append("tight")
        if self.cap is not None:
            flags.append("cap=" + ",".join(map(str, self.cap)))
        return " ".join(flags)


def placement(kind: str, num_ranks: int, chunks: int = 1) -> tuple[int, ...]:
    """Stage -> rank for `looped` (v = chunks, 1 for plain pipelines) or `v` (2 chunks)."""
    if kind == "looped":
        return looped_placement(num_ranks, chunks)
    if kind == "v":
        return v_placement(num_ranks)
    raise ValueError(f"unknown placement {kind!r}; accepted: {', '.join(PLACEMENTS)}")


def policies(*, chunks: int, braid: bool) -> list[Policy]:
    """The grid of knob settings tried for one placement, most promising first
    (the order matters when the time limit cuts the grid short)."""
    out: list[Policy] = []
    for split, prefer_b, eager_w, guard_f in (
        (True, True, True, False),
        (True, True, False, False),
        (True, False, False, False),
        (True, False, True, False),
        (True, True, False, True),
        (True, False, False, True),
        (True, True, True, True),
        (True, False, True, True),
        (False, True, False, False),
        (False, False, False, False),
    ):
        out.append(Policy(split, prefer_b, eager_w, deep_first=True, guard_f=guard_f))
    out[8:8] = [Policy(True, prefer, False, w_now=True) for prefer in (False, True)]
    if chunks == 2:
        out += [replace(p, tight=True) for p in out[:6]]
    if braid:
        braided = [
            replace(p, braid=True, braid_defer_w=defer)
            for defer in (True, False)
            for p in out[:4] + out[10:]
        ]
        out = braided + out
    return out


def warmup_caps(stage_to_rank: tuple[int, ...], costs: Costs) -> tuple[int, ...]:
    """Per rank, how many chunk forwards fit between its first forward and
    the arrival of its first backward when one microbatch runs alone: the
    in-flight count that keeps the first backward from waiting (ZB-H2's warm-up
    `2(p-s)-1` for one chunk and unit costs, Zero Bubble section 2.2)."""
    owner = stage_to_rank
    S = len(owner)
    P = max(owner) + 1
    v = S // P
    d_f, d_b = (costs.f + costs.tp_time) / v, (costs.b + costs.tp_time) / v
    t = 0.0
    f_start = [0.0] * S
    for s in range(S):
        if s and owner[s] != owner[s - 1]:
            t += costs.comm
        f_start[s] = t
        t += d_f
    b_ready = [0.0] * S
    for s in range(S - 1, -1, -1):
        b_ready[s] = t
        t += d_b + (costs.comm if s and owner[s - 1] != owner[s] else 0.0)
    caps = []
    for r in range(P):
        stages = [s for s in range(S) if owner[s] == r]
        t0, first_b = f_start[stages[0]], b_ready[stages[-1]]
        # entries alone until the rank's next chunk has work, then one entry per
        # v chunk forwards
        t1 = min(first_b, f_start[stages[1]]) if v > 1 else first_b
        n = int((t1 - t0) / d_f + 1e-9) + int(max(0.0, first_b - t1) / (v * d_f) + 1e-9)
        caps.append(max(1, n))
    return tuple(caps)
