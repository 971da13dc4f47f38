"""The one interpreter: runs a rank's lowered program with a fixed set of primitives.

A lowered program (stp.schedule.lower) is a list of compute actions (a
`Pass` or a braided `Block`) and communication actions (`Comm`). The
executor knows six primitives and nothing about schedules (one interpreter,
as DualPipe's forward / backward / weight chunk + commit comm):

    forward unit      F   stage.forward(mb, x, targets)
    backward unit     B   stage.backward_input(mb, grad, scale)
    full backward     BW  stage.backward_full(mb, grad, scale)
    weight unit       W   stage.backward_weight(mb)
    commit batch          a run of consecutive SEND/RECV posted at once
    wait receive          right before the pass that consumes it

Hand-offs between two stages on this rank (the V tip) go through a local
inbox: the producer's output is the consumer's input, no copy, no send.

Every compute action runs through `stp.runtime.braid.UnitRunner`, unit by
unit: a stage cut into units (stp.runtime.stage_api.UnitStage) interleaves
the passes of a braided block with every TP all-reduce in flight under the
other pass's compute ("Synergistic Tensor and Pipeline Parallelism", arXiv
2510.27257, Fig. 3), in the simulator's order; a stage that is not cut runs
as one unit per pass (`as_unit_stage`), so there is one path. A block's
last all-reduces may still be in flight when the block ends; a send of an
output not finished yet is posted as soon as it is (the rest of its batch
goes out at once), and before this rank blocks on anything. `braid=False`
runs units pass by pass with every all-reduce waited for at once (the
unbraided baseline).

Gradients final: `grads_final(stage)` (optional) is called once per run for
each stage this rank holds, as soon as that stage's gradients on this rank
are final for the step: right after its last gradient-producing action (its
last W, or its last full backward where B and W are fused), once that
action's held tail has finished (a braided block's last backward finish may
still add a norm gain's gradient). The schedule is data, so each stage's
last such action is known before the run. The trainer launches the stage's
data-parallel gradient reduction there (stp.train.step.grad_sync); the executor
knows nothing of it:

    compute:  .. F(7) | B(6) | W(6) stage 2 | F(7) stage 0 | B(7) | W(7) stage 0
    DP:                                 [reduce stage 2 ..............][stage 0]

Parameters needed: `params_needed(stage)` (optional), the mirror image of
`grads_final`, is called once per run for each stage this rank holds, right
before the first compute action that runs one of that stage's forwards (a
braided block's too; known before the run, `first_forward_action`). The
trainer waits there for the
stage's parameters, gathered asynchronously since the last optimizer step
(stp.train.step.param_gather); the executor knows nothing of it:

    DP:      [AG stage 0][AG stage 3 .......................]
    compute:            ^ F(0) stage 0 | F(1) | .. | F(0) stage 3
                        ^ params_needed(0)         ^ params_needed(3)

Scaling: the last stage's backward seeds the loss gradient with `scale`,
1/m by default, so weight gradients are the sum over microbatches of each
microbatch's mean-loss gradient divided by m: the gradient of the mean of
microbatch means, equal to the full-batch mean loss (microbatches of equal
size). Nothing else scales.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from stp.runtime.braid import UnitRunner
from stp.runtime.errors import RankError, wrap
from stp.runtime.executor_options import ExecutorOptions
from stp.runtime.offload import ActivationOffloader
from stp.runtime.p2p import P2P, Transfer
from stp.runtime.stage_api import PipelineStage, as_unit_stage, weights_in_backward
from stp.runtime.trace import Recorder
from stp.schedule.ir import Action, Kind, Pass, passes_of
from stp.schedule.lower import Comm, LoweredSchedule, Message

__all__ = ["Executor", "ExecutorOptions", "first_forward_actions", "last_gradient_actions"]


def _compute_passes(program: Sequence[Action | Comm]) -> Iterator[tuple[int, Pass]]:
    """(index among the program's compute actions, pass) for every pass it runs."""
    for index, action in enumerate(a for a in program if not isinstance(a, Comm)):
        for p in passes_of(action):
            yield index, p


def last_gradient_actions(program: Sequence[Action | Comm]) -> dict[int, int]:
    """{stage: index among the program's compute actions of the last one that runs a
    gradient pass (B, W or a full backward) of that stage}."""
    return {p.stage: index for index, p in _compute_passes(program) if p.kind is not Kind.F}


def first_forward_actions(program: Sequence[Action | Comm]) -> dict[int, int]:
    """{stage: index among the program's compute actions of the first one that runs a
    forward of that stage}."""
    first: dict[int, int] = {}
    for index, p in _compute_passes(program):
        if p.kind is Kind.F:
            first.setdefault(p.stage, index)
    return first


class Executor:
    """Runs pipeline rank `pp_rank`'s program of `lowered` on its local stages.

    `stages` maps each global stage this rank holds (schedule.stage_to_rank)
    to its PipelineStage. `p2p` may be None when no action sends or receives
    (one pipeline rank). `options` (ExecutorOptions), or its fields as keywords
    (not both). `offload` (stp.runtime.offload) measures resident activations
    and moves them to the host and back as its plan says; `recorder`
    (stp.runtime.trace) records every unit, all-reduce, send and receive of
    each run; `grads_final(stage)` is told when a stage's gradients are final,
    `params_needed(stage)` before its first forward of a run (module doc).
    """

    def __init__(
        self,
        lowered: LoweredSchedule,
        pp_rank: int,
        stages: Mapping[int, PipelineStage],
        p2p: P2P | None,
        options: ExecutorOptions | None = None,
        *,
        offload: ActivationOffloader | None = None,
        recorder: Recorder | None = None,
        grads_final: Callable[[int], None] | None = None,
        params_needed: Callable[[int], None] | None = None,
        boundary_shape: Sequence[int] = (1, 1, 1),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        where: str = "",
        collective_peers: str = "",
        braid: bool = True,
    ) -> None:
        given = ExecutorOptions(tuple(boundary_shape), dtype, device, where, collective_peers,
                                braid)
        if options is not None and given != ExecutorOptions():
            raise ValueError("Executor takes options=ExecutorOptions(...) or its fields as "
                             "keywords, not both")
        opts = given if options is None else options
        self.options = opts
        """How this executor runs (an Evaluator reuses it for its forward-only program)."""
        sch = lowered.schedule
        mine = set(sch.stages_of(pp_rank))
        if set(stages) != mine:
            raise ValueError(
                f"pipeline rank {pp_rank} holds stages {sorted(mine)} in schedule {sch.name}, "
                f"got stage objects for {sorted(stages)}"
            )
        self.program = lowered.actions[pp_rank]
        if p2p is None and any(isinstance(a, Comm) for a in self.program):
            raise ValueError(f"pipeline rank {pp_rank}'s program communicates but p2p is None")
        self.schedule, self.pp_rank, self.p2p = sch, pp_rank, p2p
        self.stages = dict(stages)
        self.boundary_shape = opts.boundary_shape
        self.dtype, self.device = opts.dtype, torch.device(opts.device)
        self.where = opts.where or f"pipeline rank {pp_rank}"
        self.collective_peers = opts.collective_peers
        self.offload, self.recorder = offload, recorder
        self.grads_final = grads_final
        self.last_grad_action = last_gradient_actions(self.program)
        """{stage: index among this rank's compute actions of its last gradient pass}."""
        self.params_needed = params_needed
        self.first_forward_action = first_forward_actions(self.program)
        """{stage: index among this rank's compute actions of its first forward}."""
        self._final_due: list[tuple[int, Message]] = []  # ran, tail maybe still held
        self._open: list[tuple[Transfer, float]] = []  # posted, not yet seen complete
        self.sends_deferred = 0
        """Sends posted after their batch, their all-reduce held (all runs so far)."""
        for s, st in self.stages.items():  # e.g. stp.models.decoder.stage.ModelStage
            weights_in_backward(
                st, (p.mb for p in sch.passes(pp_rank) if p.stage == s and p.kind is Kind.BW))
        self.runner = UnitRunner(
            {s: as_unit_stage(st) for s, st in self.stages.items()}, braid=opts.braid,
            take=self._input, give=self._output, targets=lambda mb: self._targets[mb],
            before_pass=offload.before_pass if offload is not None else None,
            after_pass=offload.after_pass if offload is not None else None,
            recorder=recorder,
        )

    # -- the run loop ------------------------------------------------------------

    def run(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        scale: float | None = None,
        boundary_shape: Sequence[int] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Run one iteration over all microbatches.

        `inputs[i]` are microbatch i's token ids, `targets[i]` its targets
        (only the first / last stage reads them). `scale` seeds the loss
        gradient (default 1/m); `boundary_shape` replaces the constructor's
        (e.g. another microbatch size). Returns each microbatch's mean loss
        (detached) if this rank holds the last stage, else {}.
        """
        if boundary_shape is not None:
            self.boundary_shape = tuple(boundary_shape)
        m = self.schedule.num_microbatches
        if len(inputs) != m or len(targets) != m:
            raise ValueError(
                f"schedule {self.schedule.name} runs {m} microbatches, got {len(inputs)} inputs "
                f"and {len(targets)} targets"
            )
        self._inputs, self._targets = inputs, targets
        self._scale = 1.0 / m if scale is None else scale
        self._inbox: dict[Message, torch.Tensor | Transfer] = {}
        self._outbox: dict[Message, torch.Tensor] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._deferred: dict[Message, Comm] = {}  # sends waiting for a held all-reduce
        self._index = 0  # compute actions run so far
        self._final_due = []
        self.runner.reset()
        self.runner.scale = self._scale
        if self.recorder is not None:
            self.recorder.start()
            self._open = []
        if self.offload is not None:  # activation offload: stp.runtime.offload
            self.offload.start(inputs, targets)
        prog, i = self.program, 0
        while i < len(prog):
            action = prog[i]
            if isinstance(action, Comm):
                j = i
                while j < len(prog) and isinstance(prog[j], Comm):
                    j += 1
                self._commit([a for a in prog[i:j] if isinstance(a, Comm)])
                i = j
            else:
                self._compute(action)
                i += 1
        self._guard("end of step", self.runner.release)  # the last block's held all-reduces
        self._tell_final()
        assert not self._deferred, f"{self.where}: sends never posted {sorted(self._deferred)}"
        if self.p2p is not None:
            self.p2p.drain()
            self._record_transfers()
        assert not self._inbox and not self._outbox, (
            f"{self.where}: unconsumed {sorted(self._inbox)} / unsent {sorted(self._outbox)}"
        )
        if self.offload is not None:
            self.offload.finish()
        return self._losses

    def _commit(self, comms: list[Comm]) -> None:
        assert self.p2p is not None
        batch = []
        for c in comms:
            if c.op.is_send:
                if c.message not in self._outbox:  # its all-reduce is still in flight
                    assert self.runner.holds(c.message), c
                    self._deferred[c.message] = c
                    self.sends_deferred += 1
                    continue
                # keep each channel's send order (NCCL matches by order)
                for msg in [m for m, d in self._deferred.items() if d.peer == c.peer]:
                    self._guard(str(c), self.runner.release, msg)
                batch.append((c, self._outbox.pop(c.message).contiguous()))
            else:
                buf = torch.empty(self.boundary_shape, dtype=self.dtype, device=self.device)
                batch.append((c, buf))
        self._post(batch)

    def _post(self, batch: list[tuple[Comm, torch.Tensor]]) -> None:
        assert self.p2p is not None
        now = time.perf_counter()
        for t in self.p2p.post(batch):
            if not t.comm.op.is_send:
                self._inbox[t.comm.message] = t
            if self.recorder is not None:
                self._open.append((t, now))

    def _record_transfers(self, done: Transfer | None = None) -> None:
        """Record transfer `done` (None: every open one, after the drain) as complete now.
        (Gloo reports a point-to-point work complete only to its wait.)"""
        rec = self.recorder
        if rec is None:
            return
        now, still = time.perf_counter(), []
        for t, posted in self._open:
            if done is None or t is done:
                kind = "SEND" if t.comm.op.is_send else "RECV"
                rec.transfer(str(t.comm), kind, t.comm.stage, t.comm.mb, posted, now,
                             t.peer_rank, t.comm.message)
            else:
                still.append((t, posted))
        self._open = still

    def _guard(self, action: str, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args), naming `action` in any failure (as _compute does)."""
        try:
            fn(*args)
        except RankError:
            raise
        except RuntimeError as e:
            raise self._failure(e, action) from e

    def _failure(self, e: RuntimeError, action: str) -> RankError:
        """The error naming this rank and action (stp.runtime.errors.wrap): a
        collective whose peer closed the connection, one that timed out, or
        anything else (a failure of this rank's own compute)."""
        peers = (f"a rank in {self.collective_peers}" if self.collective_peers
                 else "a rank of a collective")
        return wrap(e, where=self.where, action=action, peers=peers)

    def _compute(self, action: Action) -> None:
        off = self.offload
        index, self._index = self._index, self._index + 1
        try:
            if off is not None:
                off.before_action(action)  # issues the reloads planned here
            if self.params_needed is not None:
                for p in passes_of(action):
                    if p.kind is Kind.F and self.first_forward_action.get(p.stage) == index:
                        self.params_needed(p.stage)  # e.g. waits for its parameters
            self.runner.run(action, index)  # unit by unit, braided
        except RankError:
            raise
        except RuntimeError as e:
            raise self._failure(e, str(action)) from e
        if self.grads_final is not None:
            self._final_due += [(p.stage, Message.output_of(p)) for p in passes_of(action)
                                if self.last_grad_action.get(p.stage) == index
                                and p.kind is not Kind.F]
            self._tell_final()

    def _tell_final(self) -> None:
        """Call `grads_final` for each stage whose last gradient pass has run and whose
        held tail (a braided block's last backward finish) is finished."""
        if self.grads_final is None:
            return
        due = []
        for stage, key in self._final_due:
            if self.runner.holds(key):
                due.append((stage, key))
            else:
                self.grads_final(stage)
        self._final_due = due

    # -- the runner's inputs and outputs --------------------------------------------

    def _input(self, p: Pass) -> torch.Tensor | None:
        """The runner's `take`: pass p's input (None: the last stage's backward)."""
        st = self.stages[p.stage]
        if p.kind is Kind.F:
            return self._inputs[p.mb] if st.is_first else self._take(Message.input_of(p), p)
        return None if st.is_last else self._take(Message.input_of(p), p)

    def _output(self, p: Pass, out: torch.Tensor | None) -> None:
        """The runner's `give`: a finished pass's output."""
        st = self.stages[p.stage]
        if p.kind is Kind.F:
            if st.is_last:
                self._losses[p.mb] = out  # type: ignore[assignment]  # the last stage's forward output is its loss
            else:
                self._give(Message.output_of(p), out)  # type: ignore[arg-type]  # a forward's output on other stages is a tensor
        elif not st.is_first:
            assert out is not None, f"stage {p.stage} returned no input gradient"
            self._give(Message.output_of(p), out)

    def _give(self, msg: Message, tensor: torch.Tensor) -> None:
        if msg.consumer in self.stages:
            self._inbox[msg] = tensor  # local hand-off (V tip)
        else:
            self._outbox[msg] = tensor
            send = self._deferred.pop(msg, None)
            if send is not None:  # its batch already went out: post it alone
                self._post([(send, self._outbox.pop(msg).contiguous())])

    def _take(self, msg: Message, p: Pass) -> torch.Tensor:
        if msg not in self._inbox:
            self.runner.release(msg)  # produced here, its all-reduce held
        item = self._inbox.pop(msg, None)
        if item is None:
            raise RankError(
                f"input {msg} was neither received nor produced locally; the lowered program "
                "is inconsistent", where=self.where, action=str(p),
            )
        if isinstance(item, Transfer):
            assert self.p2p is not None
            if not item.is_completed():
                self.runner.release()  # about to block: let held sends go first
            tensor = self.p2p.wait(item, needed_by=str(p))
            self._record_transfers(item)
            return tensor
        return item
