"""What the DP gradient reductions' flat copies add to a rank's memory.

The DP gradient reduction (stp.train.step.grad_sync) reduces a flat copy of a
stage's gradients (grad bytes x its parameters P_s; with the sharded
optimizer the packed buffer, P_s, and a stage's reduce-scattered segment,
P_s / dp, the whole run's being the shard stp.costmodel.memory counts),
except in a 16-bit run (`in_place`): there each stage's fp32 main grads
already lie in a flat buffer of their own (stp.train.step.precision.
group_main_grads; packed rank-major for the sharded optimizer, stp.train.
zero), which the reduction reads in place, so only the sharded optimizer's
segment is held (per stage, with the overlap or without). The parameters
whose gradients are summed across ranks before the reduction (sequence-
parallel norm gains, replicated kv heads, a tied embedding) are still
copied; they are left out here (the specs model an untied head, and the
others are small). With the overlap
(`Features.overlap_grad_sync`, `stp train`'s default) a stage's copy is
allocated when its gradients are final (the simulator's `grads_final`), so
it is held during the rank's last backwards; off, every copy comes after
the pipeline drains. The runtime frees a copy once its reduction is seen
complete, at the next stage's launch at the earliest, at the rank's compute
end at the latest: the estimate takes the latest (an upper bound: every
copy launched is still held), and counts in `buffers` what the copies add
to the peak of resident activations (stp.costmodel.memory adds it there):

    max over t of (activations(t) + copies held at t) - max of activations(t)

zero where the copies come when enough activations are freed (1F1B's
single stage per rank, at this scale), up to grad bytes x P per rank where
they do not (a copy larger than the activations' peak, or a V schedule's
first stage finishing before its second). That part of `buffers` is
`RankMemory.copies` (`dp_copies` in `stp memory --json`'s ranks), which
`stp train --json` measures (stp.train.run.memory_measure); on the small runs of
benchmarks/results/memory.md the bound is at most 5% of the total over.
"""

from __future__ import annotations

from stp.schedule.ir import Schedule
from stp.sim.result import SimResult

__all__ = ["reduction_copies", "copies_over_peak"]


def reduction_copies(sch: Schedule, rank: int, stage_params: list[int],
                     stage_experts: list[int], *, dp: int, ep: int, width: int,
                     segments: bool, in_place: bool = False) -> dict[int, float]:
    """{stage of `rank`: bytes of the flat copy its DP gradient reduction holds} (module
    doc): `width` (the gradients' bytes) x its parameters, none when `in_place`; with
    `segments` (the sharded optimizer with the overlap, or in a 16-bit run, whose
    reduce-scatters go stage by stage either way) also the stage's reduce-scattered
    segment, its dense parameters over dp and its experts over the dp / ep ranks
    holding them (otherwise the one reduction's segment is the shard
    stp.costmodel.memory counts). Empty at dp = 1 (no reduction)."""
    if dp == 1 or (in_place and not segments):
        return {}

    def copy(s: int) -> float:
        whole, experts = stage_params[s], stage_experts[s]
        segment = width * ((whole - experts) / dp + experts * ep / dp) if segments else 0.0
        return segment + (0.0 if in_place else width * whole)

    return {s: copy(s) for s in range(sch.num_stages) if sch.stage_to_rank[s] == rank}


def copies_over_peak(res: SimResult, rank: int, copies: dict[int, float], act_scale: float,
                     overlap: bool) -> float:
    """What the reductions' copies add to the rank's peak of resident activations
    (module doc): each held from its stage's `grads_final` (overlap; else from the
    rank's compute end) to the compute end, the activations a step curve in units of
    `act_scale` bytes."""
    if not copies:
        return 0.0
    curve = res.memory[rank]
    end = max(curve[-1][0], *res.ranks[rank].grads_final.values(), 0.0)
    starts = {s: res.ranks[rank].grads_final.get(s, end) if overlap else end for s in copies}
    peak = res.ranks[rank].peak_activation * act_scale
    best, held, acts = peak, 0.0, 0.0
    events = sorted([(u, 0, v) for u, v in curve]
                    + [(t, 1, copies[s]) for s, t in starts.items()])
    for k, (t, is_copy, x) in enumerate(events):  # at equal times: the curve's value first
        if is_copy:
            held += x
        else:
            acts = x * act_scale
        if held and (k + 1 == len(events) or events[k + 1][0] > t):
            best = max(best, acts + held)
    return best - peak
