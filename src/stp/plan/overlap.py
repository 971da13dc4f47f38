"""How a plan overlaps its TP collectives: none, braided, in-layer or both.

The planner's top plans (`stp.plan.planner`, the step after the partitions)
each try the overlap modes of `stp.sim.inlayer` that change something on
their mesh and schedule, and keep the fastest that fits the budget:

    braided   the default: a braided schedule's blocks hide each other's
              collectives; a schedule without blocks runs each pass whole
    none      a braided schedule's blocks run pass by pass (`--braid off`)
    in-layer  every pass chunked into K pieces (K in 2, 4, 8), blocks pass
              by pass (`--braid off --tp-overlap`)
    both      braided blocks kept, the passes that run alone chunked
              (`--tp-overlap`); on a schedule without blocks, in-layer

In-layer overlap chunks the all-gathers and reduce-scatters of sequence
parallelism, so it is tried only with tp > 1 where sequence parallelism may
be on; a plan that did not need it to fit memory turns it on for the trial
(it costs no time in the cost model and holds fewer activations). Only the
top K are tried, as the partitions are: a configuration outside them that
overlap would lift past them is not looked for (each trial is a
simulation; at most seven a plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from stp.costmodel.inlayer import CHUNK_CHOICES
from stp.costmodel.memory import Features
from stp.plan.experts import priced
from stp.plan.price import Priced
from stp.plan.request import PlanRequest
from stp.plan.space import BRAIDED

__all__ = ["overlap_trials", "overlapped"]


def overlap_trials(request: PlanRequest, features: Features, schedule: str,
                   tp: int) -> list[Features]:
    """The features of every other overlap mode worth pricing (module doc)."""
    braids = schedule in BRAIDED
    out = [replace(features, braid=False)] if braids and tp > 1 else []
    sp_ok = features.sequence_parallel or (
        request.allow_sequence_parallel and request.seq_len % tp == 0)
    if tp == 1 or not sp_ok or features.offload != "none":
        return out  # nothing to chunk; offload's copies are priced unchunked only
    for k in CHUNK_CHOICES:
        chunked = replace(features, sequence_parallel=True, tp_overlap_chunks=k)
        out.append(chunked)
        if braids:
            out.append(replace(chunked, braid=False))
    return out


def overlapped(request: PlanRequest, first: Priced, tick: Callable[[], None]) -> Priced:
    """`first` in the fastest overlap mode that fits the budget (module doc)."""
    cfg = first.config
    best = first
    for feats in overlap_trials(request, cfg.features, cfg.schedule, cfg.mesh.tp):
        tick()
        trial = priced(request, replace(cfg, features=feats), first.partition)
        if trial.peak_bytes <= request.budget and trial.step_s < best.step_s - 1e-12:
            best = trial
    return best
