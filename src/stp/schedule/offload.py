"""Activation offload plans: which forwards' activations leave the device, and
when they come back (the offload variant of "Synergistic Tensor and Pipeline
Parallelism", arXiv 2510.27257; "PipeOffload", arXiv 2503.01328).

A plan is data beside the schedule, read by the simulator and the runtime
alike: for each offloaded pass F(stage, mb) on rank r, its saved activations
are copied device-to-host right after that forward (on a side lane) and copied
back host-to-device when the rank's stream reaches action `reload_at`, ahead
of the backward that needs them. Text form of the copies in per-rank lists:
`0OFFLOAD3` after `0F3`, `0RELOAD3` before the action at `reload_at`.

Policies that need no timing live here (`stp`, `all`, `none`); `selective:X`
needs activation lifetimes and is planned by `stp.sim.offload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stp.schedule.ir import Kind, Schedule, passes_of

__all__ = ["OffloadPlan", "positions", "plan_chunks", "parse_policy", "POLICIES", "STP_CHUNK"]

POLICIES = ("none", "stp", "selective:X", "all")

STP_CHUNK = 0
"""The chunk (per rank) whose activations the `stp` policy copies to host
memory ("Synergistic Tensor and Pipeline Parallelism", arXiv 2510.27257,
offloading schedule). On the V placement chunk 0's forward runs first and its
backward last, so its activations live longest: the long gap hides the copy
out and back, and they are most of the peak; chunk 1 mostly stays resident."""


@dataclass(frozen=True)
class OffloadPlan:
    """(stage, mb) -> index of the action on the owning rank before which the
    reload is issued. Empty plan = no offload."""

    reload_at: dict[tuple[int, int], int] = field(default_factory=dict)
    policy: str = "none"

    def __len__(self) -> int:
        return len(self.reload_at)

    def rows(self, schedule: Schedule) -> list[list[str]]:
        """Per-rank action strings with OFFLOAD/RELOAD copies inserted."""
        out: list[list[str]] = []
        for r, acts in enumerate(schedule.actions):
            reload_before: dict[int, list[str]] = {}
            for (s, i), pos in self.reload_at.items():
                if schedule.stage_to_rank[s] == r:
                    reload_before.setdefault(pos, []).append(f"{s}RELOAD{i}")
            row: list[str] = []
            for k, a in enumerate(acts):
                row += sorted(reload_before.get(k, []))
                row.append(str(a))
                for p in passes_of(a):
                    if p.kind is Kind.F and (p.stage, p.mb) in self.reload_at:
                        row.append(f"{p.stage}OFFLOAD{p.mb}")
            out.append(row)
        return out


def positions(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """(stage, mb) -> (index of its forward's action, index of its backward's
    action) on the owning rank."""
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    for acts in schedule.actions:
        for k, a in enumerate(acts):
            for p in passes_of(a):
                if p.kind is Kind.F:
                    fwd[(p.stage, p.mb)] = k
                elif p.kind in (Kind.B, Kind.BW):
                    bwd[(p.stage, p.mb)] = k
    return {key: (fwd[key], bwd[key]) for key in fwd if key in bwd}


def plan_chunks(
    schedule: Schedule, chunks: set[int] | None, *, ahead: int = 1, policy: str = ""
) -> OffloadPlan:
    """Offload every forward of the given chunks (None: all chunks), reloading
    `ahead` actions before the backward. Passes whose backward is fewer than
    `ahead + 1` actions after their forward gain nothing and are skipped."""
    if ahead < 1:
        raise ValueError(f"reload lead {ahead} must be >= 1 action")
    plan: dict[tuple[int, int], int] = {}
    for (s, i), (f_at, b_at) in positions(schedule).items():
        if chunks is not None and schedule.chunk_of(s) not in chunks:
            continue
        reload_at = b_at - ahead
        if reload_at > f_at:
            plan[(s, i)] = reload_at
    return OffloadPlan(plan, policy)


def parse_policy(text: str | None) -> tuple[str, float | None]:
    """'none' | 'stp' | 'all' | 'selective:X' (0 < X < 1) -> (name, X)."""
    text = (text or "none").strip()
    if text in ("none", "stp", "all"):
        return text, None
    if text.startswith("selective:"):
        raw = text.partition(":")[2]
        try:
            x = float(raw)
        except ValueError:
            x = -1.0
        if not 0 < x < 1:
            raise ValueError(
                f"offload policy {text!r}: X must be a fraction between 0 and 1 "
                "(the peak cut to aim for), e.g. selective:0.3"
            )
        return "selective", x
    raise ValueError(f"unknown offload policy {text!r}; accepted: {', '.join(POLICIES)}")
