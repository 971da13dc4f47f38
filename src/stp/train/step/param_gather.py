"""The sharded optimizer's parameter all-gather overlapped with the next step's forward.

With `shard_optimizer` (stp.train.step.zero) each rank updates only its rows of
every parameter; an all-gather then rebuilds the whole parameters. Without
the overlap it runs right after the optimizer step, exposed. With
`overlap_param_gather` (Megatron-LM's `--overlap-param-gather`) each stage's
all-gathers (its dense parameters over DP, its experts over EDP) are
launched asynchronously after the step, and the executor waits for a
stage's only just before that stage's first forward of the next step
(`params_needed`, stp.runtime.executor), so it runs under the compute of
the forwards before it, and under whatever the host does between steps:

    step k:    .. W(7) | optimizer step |
    DP:                                 [AG stage 0][AG stage 3 ...........]
    step k+1:                           ^wait | F(0) stage 0 | F(1) | ^wait F(0) stage 3

The values are the same as gathered at once (only copies): a float64 run
equals the one without the overlap bit for bit.

Anything else that reads the model parameters between two steps (a
checkpoint, an evaluation, a gathered state dict, an export, the end of
training) first calls `finish` (stp.train.step.trainer.Trainer.finish_param_gather):
waiting is local to this rank, every rank having launched the all-gathers
in the same optimizer step, so a non-collective reader may wait too.

A failed all-gather surfaces when waited for, as the rank error every
collective raises (stp.train.step.grad_sync.collective: this rank, the action
"parameter all-gather" and the group it waited on). The trace records each
in the dp lane (kind `DP-AG`) in the step whose forward waited for it, from
its launch (at the earliest the step's start) to its completion; one a
reader finished between two steps is not traced.

The gathered buffers (a stage's parameters in the model's dtype, and this
rank's rows of them) are held from the step until the stage's first forward:
at most one more copy of this rank's parameters in the model's dtype, plus
1 / dp of it, at the step's boundary (not in `stp memory`'s estimate).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from stp.runtime.trace import Recorder, Watched
from stp.train.step.in_flight import InFlight
from stp.train.step.zero import ShardedPrecision

__all__ = ["ParamGather"]

KIND = "DP-AG"
"""The trace's kind of a parameter all-gather (the dp lane)."""


class ParamGather:
    """One rank's parameter all-gathers in flight between two steps, stage by stage.

    `precision`: the sharded optimizer; `stage_params`: {stage: indices of its
    parameters in the precision's lists}, in the order this rank's program
    first runs a forward of each stage (the order they are launched in, the
    same on every DP peer); `recorder` (stp.runtime.trace): records them.
    """

    def __init__(self, precision: ShardedPrecision, stage_params: Mapping[int, Sequence[int]],
                 recorder: Recorder | None = None) -> None:
        self.precision = precision
        self.stage_params = {s: list(idx) for s, idx in stage_params.items()}
        self.recorder = recorder
        self._in_flight: dict[int, list[tuple[InFlight, Watched | None]]] = {}

    @property
    def in_flight(self) -> bool:
        """Some stage's parameters are not written yet."""
        return bool(self._in_flight)

    def launch(self) -> None:
        """After the optimizer step (in place of `copy_to_model`): every stage's
        all-gathers launched, none waited for. Collective."""
        self.finish()  # nothing of an earlier step may land after these
        for stage, idx in self.stage_params.items():
            flights = self.precision.all_gather(idx, async_op=True)
            self._in_flight[stage] = [(f, self._seen(f)) for f in flights]

    def _seen(self, flight: InFlight) -> Watched | None:
        """When the work completes, from its completion callback (tracing only): it is
        recorded later, in the step that waits for it."""
        if self.recorder is None or flight.work is None:
            return None
        seen = Watched(flight.launched)
        try:
            flight.work.get_future().then(lambda _: seen.done(time.perf_counter()))
        except (AttributeError, RuntimeError):  # no callback: the wait stamps it
            return None
        return seen

    def params_needed(self, stage: int) -> None:
        """The executor's hook before `stage`'s first forward of a run: wait for its
        all-gathers and write its parameters (nothing when none is in flight)."""
        self._wait(stage, record=True)

    def finish(self) -> None:
        """Wait for every all-gather in flight and write the parameters (a reader of
        the model between two steps calls this first; not traced: no step waits)."""
        for stage in list(self._in_flight):
            self._wait(stage, record=False)

    def _wait(self, stage: int, *, record: bool) -> None:
        for flight, seen in self._in_flight.pop(stage, ()):
            if record:
                self._record(stage, flight, seen)
            flight.finish()

    def _record(self, stage: int, flight: InFlight, seen: Watched | None) -> None:
        rec = self.recorder
        if rec is None:
            return
        launched = max(flight.launched, rec.origin)  # launched before this run started
        flight.watched = rec.reduction(flight.work, f"{KIND} stage {stage}", KIND, stage,
                                       launched)
        if seen is not None and seen.done_at is not None:
            flight.watched.done(max(seen.done_at, launched))
