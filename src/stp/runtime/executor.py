"""The one interpreter: runs a rank's lowered program with a fixed set of primitives.

A lowered program (stp.schedule.lower) is a list of compute actions (a
`Pass` or a braided `Block`) and communication actions (`Comm`). The
executor knows six primitives and nothing about schedules (STYLE.md: "one
interpreter"; DualPipe's forward / backward / weight chunk + commit comm):

    forward unit      F   stage.forward(mb, x, targets)
    backward unit     B   stage.backward_input(mb, grad, scale)
    full backward     BW  stage.backward_full(mb, grad, scale)
    weight unit       W   stage.backward_weight(mb)
    commit batch          a run of consecutive SEND/RECV posted at once
    wait receive          right before the pass that consumes it

Hand-offs between two stages on this rank (the V tip) go through a local
inbox: the producer's output is the consumer's input, no copy, no send.
The passes of a braided block run one after the other here; their
interleaving at unit granularity is the model side's (stp.models units).

Scaling: the last stage's backward seeds the loss gradient with `scale`,
1/m by default, so weight gradients are the sum over microbatches of each
microbatch's mean-loss gradient divided by m: the gradient of the mean of
microbatch means, equal to the full-batch mean loss (microbatches of equal
size). Nothing else scales.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from stp.runtime.errors import CommTimeout, RankError, first_line, is_timeout
from stp.runtime.p2p import P2P, Transfer
from stp.runtime.stage_api import PipelineStage
from stp.schedule.ir import Action, Kind, Pass, passes_of
from stp.schedule.lower import Comm, LoweredSchedule

__all__ = ["Executor"]

Message = tuple[str, int, int]


class Executor:
    """Runs pipeline rank `pp_rank`'s program of `lowered` on its local stages.

    `stages` maps each global stage this rank holds (schedule.stage_to_rank)
    to its PipelineStage. `boundary_shape`/`dtype`/`device` describe the
    tensors crossing stage boundaries (hidden states [b, s, h] and their
    gradients), used to allocate receive buffers. `p2p` may be None when no
    action sends or receives (one pipeline rank). `collective_peers` names
    the group a stage's own collectives wait on (for timeout messages).
    """

    def __init__(
        self,
        lowered: LoweredSchedule,
        pp_rank: int,
        stages: Mapping[int, PipelineStage],
        p2p: P2P | None,
        *,
        boundary_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        where: str = "",
        collective_peers: str = "",
        trace: bool = False,
    ) -> None:
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
        self.schedule = sch
        self.pp_rank = pp_rank
        self.stages = dict(stages)
        self.p2p = p2p
        self.boundary_shape = tuple(boundary_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.where = where or f"pipeline rank {pp_rank}"
        self.collective_peers = collective_peers
        self.trace_enabled = trace
        self.trace: list[tuple[str, float, float]] = []
        """(action, start, end) of every compute action of the last run, seconds."""

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
        self.trace = []
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
        if self.p2p is not None:
            self.p2p.drain()
        assert not self._inbox and not self._outbox, (
            f"{self.where}: unconsumed {sorted(self._inbox)} / unsent {sorted(self._outbox)}"
        )
        return self._losses

    def _commit(self, comms: list[Comm]) -> None:
        assert self.p2p is not None
        batch = []
        for c in comms:
            if c.op.is_send:
                batch.append((c, self._outbox.pop(c.message).contiguous()))
            else:
                buf = torch.empty(self.boundary_shape, dtype=self.dtype, device=self.device)
                batch.append((c, buf))
        for t in self.p2p.post(batch):
            if not t.comm.op.is_send:
                self._inbox[t.comm.message] = t

    def _compute(self, action: Action) -> None:
        start = time.perf_counter()
        try:
            for p in passes_of(action):  # a braided block: passes in order
                self._run_pass(p)
        except RankError:
            raise
        except RuntimeError as e:
            first = first_line(e)
            if is_timeout(e):
                peers = f" on {self.collective_peers}" if self.collective_peers else ""
                raise CommTimeout(
                    f"a collective{peers} timed out or lost a peer ({first})",
                    where=self.where, action=str(action),
                ) from e
            raise RankError(first, where=self.where, action=str(action)) from e
        if self.trace_enabled:
            self.trace.append((str(action), start, time.perf_counter()))

    # -- primitives ---------------------------------------------------------------

    def _run_pass(self, p: Pass) -> None:
        st = self.stages[p.stage]
        if p.kind is Kind.F:
            x = self._inputs[p.mb] if st.is_first else self._take(("F", p.stage - 1, p.mb), p)
            y = st.forward(p.mb, x, self._targets[p.mb] if st.is_last else None)
            if st.is_last:
                self._losses[p.mb] = y
            else:
                self._give(("F", p.stage, p.mb), y)
        elif p.kind in (Kind.B, Kind.BW):
            grad = None if st.is_last else self._take(("B", p.stage + 1, p.mb), p)
            run = st.backward_input if p.kind is Kind.B else st.backward_full
            grad_in = run(p.mb, grad, self._scale)
            if not st.is_first:
                assert grad_in is not None, f"stage {p.stage} returned no input gradient"
                self._give(("B", p.stage, p.mb), grad_in)
        else:
            st.backward_weight(p.mb)

    def _give(self, msg: Message, tensor: torch.Tensor) -> None:
        consumer = msg[1] + 1 if msg[0] == "F" else msg[1] - 1
        if consumer in self.stages:
            self._inbox[msg] = tensor  # local hand-off (V tip)
        else:
            self._outbox[msg] = tensor

    def _take(self, msg: Message, p: Pass) -> torch.Tensor:
        item = self._inbox.pop(msg, None)
        if item is None:
            raise RankError(
                f"input {msg} was neither received nor produced locally; the lowered program "
                "is inconsistent", where=self.where, action=str(p),
            )
        if isinstance(item, Transfer):
            assert self.p2p is not None
            return self.p2p.wait(item, needed_by=str(p))
        return item
