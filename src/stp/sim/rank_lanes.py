"""One rank as the simulator (stp.sim.engine) advances it: where each of its
lanes is free, its running totals, its memory events; and the events swept
into the rank's resident-activation curve and peak."""

from __future__ import annotations

from stp.schedule.ir import Action, Done
from stp.sim.result import RankStats

__all__ = ["MemEvent", "RankLanes", "memory_curves"]

MemEvent = tuple[float, float]
"""(time, change of resident activations in M_B)."""


class RankLanes:
    """One rank as the simulation advances: where each lane is free, its
    running totals and its memory events."""

    def __init__(self, index: int, actions: tuple[Action, ...]) -> None:
        self.index, self.actions = index, actions
        self.next = 0
        """Position of the next action to run."""
        self.lane = 0.0
        """Compute lane free."""
        self.tp = 0.0
        """TP lane free (last all-reduce issued ends)."""
        self.d2h = self.h2d = 0.0
        """Offload copy lanes free."""
        self.first_f = float("inf")
        self.last_end = self.busy = self.tp_wait = self.off_wait = self.tp_total = 0.0
        self.a2a_wait = self.a2a_total = 0.0
        self.grads_final: dict[int, float] = {}
        """Stage -> end of its last gradient pass (B, W or a full backward) so far."""
        self.mem_events: list[MemEvent] = []
        self.waiting: Done | None = None
        """A result the next action needs that was missing when last checked."""
        self.reloads_at: dict[int, list[tuple[int, int]]] = {}
        """Action position -> (stage, mb) whose copy back starts there."""

    def stats(self, peak: float) -> RankStats:
        return RankStats(
            rank=self.index,
            start=self.first_f if self.first_f != float("inf") else 0.0,
            end=self.last_end,
            compute=self.busy,
            exposed_tp=self.tp_wait,
            peak_activation=peak,
            exposed_offload=self.off_wait,
            tp_total=self.tp_total,
            exposed_a2a=self.a2a_wait,
            a2a_total=self.a2a_total,
            grads_final=dict(self.grads_final),
        )



def memory_curves(
    events: list[list[MemEvent]],
) -> tuple[list[list[tuple[float, float]]], list[float]]:
    """Sweep each rank's (time, delta) events in time order, frees first at
    equal times (so an action that starts as another ends does not count
    both), into step curves and peaks."""
    curves, peaks = [], []
    for ev in events:
        ev.sort(key=lambda e: (e[0], e[1] > 0))
        cur = peak = 0.0
        curve = [(0.0, 0.0)]
        for t, d in ev:
            cur += d
            peak = max(peak, cur)
            if curve[-1][0] == t:
                curve[-1] = (t, cur)
            else:
                curve.append((t, cur))
        curves.append(curve)
        peaks.append(peak)
    return curves, peaks
