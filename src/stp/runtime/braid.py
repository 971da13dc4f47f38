"""Braided execution on the runtime: an action run unit by unit, all-reduces in flight.

A pass through a stage is a chain of units (stp.models.decoder.units: attention, MLP,
plus the embedding / loss units of the first / last stage); each F or B unit
ends in a TP all-reduce of its partial sum (STP paper, arXiv
2510.27257, Fig. 2). `UnitRunner`
runs a compute action (a lone pass or a braided `Block`) on the compute stream
in the simulator's braid order (stp.sim.units.braid; the paper's Fig. 3):

    compute:  Attn F(i) | MLP B(j) | MLP W(j) | MLP F(i) | Attn B(j) | Attn W(j)
    TP:                 [AR Attn F(i)]     [AR MLP B(j)]      [AR MLP F(i)] ...
                                    ^ waited here: MLP F(i) needs it

Each all-reduce is launched right after its unit's partial step and waited for
only just before the next unit of the same chain, which needs the reduced
tensor (its finish is folded into the start of that unit). The rules are the
simulator's (stp.sim.engine), so a measured run and a simulated one line up:

* a lone pass waits for each of its all-reduces in turn, the last one before
  the action ends (plain TP code);
* a full backward, alone or in a block, runs W_u while AR(B_u) is in flight:
  W of a unit needs only B's partial step (stp.models.decoder.units, early W);
* in a block, a chain's last all-reduce is held: it runs under the next
  action and the pass's output (hence its send, stp.runtime.executor) is
  finished when it completes. Held tails are finished as soon as a poll after
  a unit finds their all-reduce done, when a later pass needs them, and
  before the stream blocks: on a receive, all of them; on an all-reduce, those
  launched before it. A held send then never waits on something that came
  after it (no cycle through a peer), and a younger tail stays hidden.

Under sequence parallelism (stp.models.tp.sequence) a unit's collective is a
reduce-scatter, braided by the same rules, and the next unit of the chain
starts with an all-gather that needs it (through the residual add and the
norm). Where the braid puts two or more items between a chain's units, the
runner *advances* the chain after the first of them: it waits for the
reduce-scatter, runs the finish and the next unit's `prepare_*` (norm, gather
launched), so the gather flies under the next item. A full backward braided
with a forward gives that room (the paper's order):

    compute:  Attn F(i) | MLP B(j) |adv F| MLP W(j) |adv B| MLP F(i) | Attn B(j) ...
    TP:            [RS Attn F(i)]      [AG F(i)]            ^ waits AG
                               [RS MLP B(j) ......][AG B(j) ........]

Between alternating F and B units (W deferred) there is one item: the
reduce-scatter hides there and the gather runs at the unit's start, exposed.
The advance points depend on the order only, never on timing, so every TP
rank issues its collectives in the same order. Gathers are timed by the
stage (`take_gathers`): their launches and waits count as exposed
(RunnerStats) and go to the trace as AG.

With `braid=False` the same units run pass after pass (a full backward as all
B units then all W units) and every all-reduce is waited for at once: the
unbraided baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stp.runtime.stage_api import UnitStage, prepares_gathers, take_gathers
from stp.schedule.ir import Action, Kind, Pass, passes_of
from stp.schedule.lower import Message
from stp.sim.units import Item, UnitKind, braid_counts, sequential_order

__all__ = ["stream_order", "RunnerStats", "UnitRunner"]

def stream_order(action: Action, counts: Sequence[int]) -> tuple[Item, ...]:
    """Items of `action` in stream order; counts[c] = units of pass c's stage.
    The simulator's rule (`stp.sim.units.braid_counts`), so a measured trace
    lines up with the simulated one unit for unit."""
    return braid_counts(action, tuple(counts))


@dataclass
class RunnerStats:
    """Compute-stream time spent on TP all-reduces, accumulated over runs."""

    launched: int = 0
    launch_s: float = 0.0
    """Time in the launch calls."""
    wait_s: float = 0.0
    """Time blocked waiting for an all-reduce to complete."""
    gather_s: float = 0.0
    """Compute-stream time in the all-gathers of sequence parallelism (launch + wait)."""
    advanced: int = 0
    """Units whose all-gather was launched early (an advance, see the module doc)."""

    @property
    def exposed_s(self) -> float:
        """TP collective time on the compute stream: launches plus waits (plus the
        all-gathers of sequence parallelism)."""
        return self.launch_s + self.wait_s + self.gather_s


class _AR:
    """One all-reduce in flight (work None: already complete); `seq` orders launches."""

    __slots__ = ("tensor", "work", "launched", "done_at", "seq")

    def __init__(self, tensor: torch.Tensor | None, work: Any, launched: float,
                 seq: int = 0) -> None:
        self.tensor, self.work, self.launched, self.seq = tensor, work, launched, seq
        self.done_at: float | None = None if work is not None else launched

    def completed(self) -> bool:
        if self.work is None or self.work.is_completed():
            if self.done_at is None:
                self.done_at = time.perf_counter()
            return True
        return False


@dataclass
class _Chain:
    """A pass being run: its stage, current tensor and the all-reduce it waits on."""

    p: Pass
    stage: UnitStage
    value: Any = None
    ar: _AR | None = None
    finished: bool = False
    advanced: int = -1
    """Order index of the item whose finish and prepare already ran (an advance)."""

    @property
    def key(self) -> Message:
        return Message.output_of(self.p)


Hook = Callable[[Pass], None]


def _advance_points(order: Sequence[Item], chains: Sequence[_Chain]
                    ) -> dict[int, list[tuple[int, int]]]:
    """{item index m: [(chain, index k of its next F/B item)]}: advance that chain
    right after item m, the first item after its previous unit, when at least one
    more item runs before k (room for the all-gather). Only for stages whose units
    gather (`prepares_gathers`, sequence parallelism)."""
    out: dict[int, list[tuple[int, int]]] = {}
    last: dict[int, int] = {}  # chain -> index of its latest F/B item
    for k, it in enumerate(order):
        if it.kind is UnitKind.W:
            continue
        j = last.get(it.chain)
        last[it.chain] = k
        if j is not None and k - j >= 3 and prepares_gathers(chains[it.chain].stage):
            out.setdefault(j + 1, []).append((it.chain, k))
    return out


class UnitRunner:
    """Runs compute actions on `stages` (stage index -> UnitStage) unit by unit.

    `take(p)` returns pass p's input (token ids or a received tensor; None for
    the backward of the last stage), `give(p, out)` receives its output (a
    forward's activation or loss, a backward's input gradient, None on the
    first stage). `targets(mb)` feeds the loss unit; `scale` seeds the loss
    gradient. `before_pass` / `after_pass` run around each pass (activation
    offload). `recorder` (stp.runtime.trace.Recorder) records unit and
    all-reduce spans.
    """

    def __init__(
        self,
        stages: Mapping[int, UnitStage],
        *,
        braid: bool = True,
        take: Callable[[Pass], Any],
        give: Callable[[Pass, Any], None],
        targets: Callable[[int], Any],
        before_pass: Hook | None = None,
        after_pass: Hook | None = None,
        recorder: Any = None,
    ) -> None:
        self.stages, self.braid = dict(stages), braid
        self.take, self.give, self.targets = take, give, targets
        self.before_pass, self.after_pass = before_pass, after_pass
        self.recorder = recorder
        self.scale = 1.0
        self.stats = RunnerStats()
        self._held: dict[Message, _Chain] = {}
        self._where = (-1, False)  # (action index, braided) of the running action
        self._seq = 0  # all-reduces launched

    # -- actions -----------------------------------------------------------------

    def run(self, action: Action, index: int = -1) -> None:
        """Run one action (`index`: its position in the rank's list, for traces)."""
        ps = passes_of(action)
        chains = [_Chain(p, self.stages[p.stage]) for p in ps]
        counts = [len(ch.stage.units) for ch in chains]
        order = (stream_order if self.braid else sequential_order)(action, counts)
        last = {it.chain: k for k, it in enumerate(order)}
        hold = self.braid and len(ps) > 1
        advances = _advance_points(order, chains) if hold else {}
        self._where = (index, len(ps) > 1)
        for k, it in enumerate(order):
            ch = chains[it.chain]
            if it.first:
                self._begin(ch)
            # the previous unit of this chain: its all-reduce, then its finish
            ready = ch.advanced == k
            reduced = self._reduced(ch) if (
                it.kind is not UnitKind.W and not it.first and not ready) else None
            start = time.perf_counter()
            units, mb, u = ch.stage.units, ch.p.mb, it.unit
            if it.kind is UnitKind.F:
                if not it.first and not ready:
                    ch.value = units[u - 1].forward_finish(mb, reduced)
                last_unit = u == counts[it.chain] - 1 and ch.stage.is_last
                partial = units[u].forward_partial(
                    mb, ch.value, self.targets(mb) if last_unit else None)
                self._launch(ch, partial, u)
            elif it.kind is UnitKind.B:
                if not it.first and not ready:
                    ch.value = units[u + 1].backward_finish(mb, reduced)
                self._launch(ch, units[u].backward_partial(mb, ch.value), u)
            else:
                units[u].weight(mb)
            if self.recorder is not None:
                self.recorder.unit(ch.p, it.kind.value, ch.stage, u, start, time.perf_counter(),
                                   *self._where)
            self._gathers(ch, u)
            for c, later in advances.get(k, ()):
                self._advance(chains[c], order[later], later)
            if not self.braid and ch.ar is not None:
                self._wait(ch.ar)  # unbraided: every all-reduce at once
            if last[it.chain] == k:
                if hold and ch.ar is not None:
                    self._held[ch.key] = ch
                else:
                    self._finish(ch)
            self.poll()

    def poll(self) -> None:
        """Finish the held tails whose all-reduce has completed."""
        for key in [k for k, ch in self._held.items() if ch.ar is None or ch.ar.completed()]:
            self._finish(self._held.pop(key))

    def holds(self, key: Message) -> bool:
        return key in self._held

    def release(self, key: Message | None = None, before: int | None = None) -> None:
        """Finish held tail `key` (None: all of them, oldest first; `before`: those
        whose all-reduce was launched before launch number `before`)."""
        if key is not None:
            keys = [key] if key in self._held else []
        else:
            keys = [k for k, ch in self._held.items()
                    if before is None or ch.ar is None or ch.ar.seq < before]
        for k in keys:
            ch = self._held.pop(k, None)
            if ch is not None:
                self._finish(ch)

    def reset(self) -> None:
        self._held.clear()

    # -- unit steps --------------------------------------------------------------

    def _begin(self, ch: _Chain) -> None:
        p, st = ch.p, ch.stage
        if p.kind is not Kind.F:  # its own forward (or B, for a W) must be finished
            self.release(Message.output_of(Pass(p.stage, Kind.B if p.kind is Kind.W else Kind.F,
                                                p.mb)))
        if self.before_pass is not None:
            self.before_pass(p)
        if p.kind is Kind.F:
            ch.value = self.take(p)
            st.check_input(ch.value, self.targets(p.mb) if st.is_last else None)
        elif p.kind is not Kind.W:
            ch.value = self.take(p) if not st.is_last else torch.tensor(
                self.scale, dtype=torch.float64)

    def _launch(self, ch: _Chain, partial: torch.Tensor | None, u: int) -> None:
        if partial is None:  # nothing to reduce (the embedding's backward)
            ch.ar = _AR(None, None, time.perf_counter())
            return
        t0 = time.perf_counter()
        tensor, work = ch.stage.launch_allreduce(partial)
        self._seq += 1
        ch.ar = _AR(tensor, work, t0, self._seq)
        self.stats.launch_s += time.perf_counter() - t0
        if self.recorder is not None and work is not None:
            self.recorder.allreduce(ch.ar, ch.p, ch.stage, u, *self._where,
                                    kind=getattr(partial, "collective", "AR"))
        self.stats.launched += work is not None

    def _advance(self, ch: _Chain, it: Item, k: int) -> None:
        """Run chain ch up to item `it`'s all-gather (see the module doc): wait for
        the previous unit's reduce-scatter, finish that unit, prepare unit it.unit."""
        reduced = self._reduced(ch)
        units, mb, u = ch.stage.units, ch.p.mb, it.unit
        if it.kind is UnitKind.F:
            ch.value = units[u - 1].forward_finish(mb, reduced)
            units[u].prepare_forward(mb, ch.value)
        else:
            ch.value = units[u + 1].backward_finish(mb, reduced)
            units[u].prepare_backward(mb, ch.value)
        ch.advanced = k
        self.stats.advanced += 1

    def _gathers(self, ch: _Chain, u: int) -> None:
        """The all-gathers unit u waited for: timed and traced."""
        for start, end, exposed in take_gathers(ch.stage):
            self.stats.gather_s += exposed
            if self.recorder is not None:
                self.recorder.gather(ch.p, ch.stage, u, start, end, *self._where)

    def _reduced(self, ch: _Chain) -> torch.Tensor | None:
        ar = ch.ar
        assert ar is not None, f"{ch.p}: no all-reduce to wait for"
        self._wait(ar)
        ch.ar = None
        return ar.tensor

    def _wait(self, ar: _AR) -> None:
        if ar.completed():
            return
        if self._held:  # never block while holding an older tail (its send)
            self.release(before=ar.seq)
            if ar.completed():
                return
        t0 = time.perf_counter()
        ar.work.wait()
        ar.done_at = time.perf_counter()
        self.stats.wait_s += ar.done_at - t0

    def _finish(self, ch: _Chain) -> None:
        """The pass's last finish (after its last all-reduce) and its output."""
        if ch.finished:
            return
        ch.finished = True
        p, units = ch.p, ch.stage.units
        if p.kind is Kind.F:
            out = units[-1].forward_finish(p.mb, self._reduced(ch))
            self.give(p, out.detach())
        elif p.kind is not Kind.W:
            out = units[0].backward_finish(p.mb, self._reduced(ch))
            self.give(p, out)
        if self.after_pass is not None:
            self.after_pass(p)
