"""The DP gradient reductions of one rank on the simulated timeline.

With the overlap (stp's runtime default, stp.train.step.grad_sync; Megatron-LM's
`--overlap-grad-reduce`) each stage's DP reduction starts when that stage's
last gradient pass (its last W, or its last full backward) ends, and the
reductions of a rank run one after another on its DP link (one
communicator, launched in the order the stages finish):

    compute:  ... W stage 3 | F B W stage 0 ... | W stage 0 |
    DP link:                [reduce stage 3 ......]         [reduce stage 0 ..]
                                                            ^ compute ends
                                                  exposed:   <---------------->

What ends after the rank's compute is exposed; the rest ran under the
passes still to come. Without the overlap every reduction starts when the
pipeline has drained, so all of it is exposed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DPTimeline", "dp_timeline"]


@dataclass(frozen=True)
class DPTimeline:
    """One rank's DP reductions: when they end, how long they take in all, and the
    part that runs after the rank's compute ends."""

    end: float
    """When the rank's last reduction ends (its compute end when it has none)."""
    total: float
    """The reductions' time, one after another."""
    exposed: float
    """max(0, end - the rank's compute end)."""


def dp_timeline(finals: Mapping[int, float], times: Mapping[int, float], compute_end: float,
                *, overlap: bool = True) -> DPTimeline:
    """The reductions of the stages `times` ({stage: its reduction's time}) of a rank
    whose compute ends at `compute_end`; `finals` ({stage: end of its last gradient
    pass}) says when each may start (`overlap` False: all at `compute_end`). In the
    order they become ready (ties: by stage), each after the previous one; one
    time unit throughout."""
    def ready(s: int) -> float:
        return finals.get(s, compute_end) if overlap else compute_end

    t = float("-inf")
    for s in sorted(times, key=lambda s: (ready(s), s)):
        t = max(t, ready(s)) + times[s]
    end = max(t, compute_end)
    return DPTimeline(end, sum(times.values()), end - compute_end)
