"""Activation offload in the runtime: STP's offload variant ("Synergistic Tensor
and Pipeline Parallelism", arXiv 2510.27257) and PipeOffload's selective
offload ("PipeOffload", arXiv 2503.01328: offload the longest-lived
activations first; skip those living shorter than about three round trips), run as the
schedule's `OffloadPlan` says (stp.schedule.offload: `0OFFLOAD3` right after
`0F3`, `0RELOAD3` before the action at `reload_at`).

What leaves the device. A forward of microbatch i through stage s keeps,
until its backward:
  * what the stage keeps itself (`kept_tensors(i)`: stp.models units' saved
    inputs, outputs and graph roots), and
  * what autograd saved in the graphs hanging off those roots (stp's own
    Functions' `ctx.save_for_backward`, the `_saved_*` of built-in nodes),
less what is not the microbatch's own: parameters and tensors every
microbatch shares (`shared_tensors()`, e.g. rotary tables), and the step's
data (token ids, targets). Tensors are grouped by storage: `h` and
`h_in = h.detach()` are one storage, counted and copied once.

How. Storage resize, as FSDP frees parameters: once the copy to the host has
ended, the device storage is resized to 0 bytes. Every tensor and view over it
(in the unit's fields, in autograd's saved variables) keeps its identity,
shape and version counter, so autograd never notices. The reload resizes it
back and copies the bytes in.

Stream safety, the two traps seen in published offload code (timeline and
stream rules in stp.runtime.offload_copy):
  * reload waited before use: the compute stream waits on the copy in's
    event before the backward runs (`before_pass`);
  * nothing freed early: the device storage is freed only after the copy
    out's event has completed (polled at every call), so the allocator cannot
    hand its memory to the compute stream while the copy still reads it; a
    host buffer is dropped only after the copies that use it have completed.
On CPU the same code runs with synchronous copies into separate host buffers
(`HostCopier`), so CI tests the logic.

Resident activation bytes: bytes of the storages above still on the device,
for every microbatch this rank holds, from its forward to its backward, plus
what the split backward keeps from B until W (Zero Bubble's M_W: the W
store). Sampled after every pass and reload; `peak_bytes` is the step's
maximum (the simulator's `peak_activation`, in bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stp.runtime.graph_saved import graph_saved
from stp.runtime.offload_copy import (
    Copier,
    CopyEvent,
    CudaCopier,
    HostBuffer,
    HostCopier,
    byte_view,
)
from stp.runtime.stage_api import kept_tensors, shared_tensors
from stp.schedule.ir import Action, Kind, Pass, Schedule
from stp.schedule.offload import OffloadPlan
from stp.sim.costs import Costs, MemCosts, OffloadCosts
from stp.sim.offload import plan_offload

__all__ = [
    "ActivationOffloader",
    "Copier",
    "CudaCopier",
    "HostCopier",
    "StepMemory",
    "runtime_plan",
]

Key = tuple[int, int]  # (stage, microbatch)


def runtime_plan(schedule: Schedule, policy: str | None) -> OffloadPlan:
    """The plan the runtime runs for `--offload POLICY`.

    `stp` and `all` depend on the action order only. `selective:X` ranks
    activations by simulated lifetime: the runtime plans it with the
    simulator's default costs (f = b = w = 1, a copy of one M_B in one time
    unit), not with measured times. Raises ValueError on an unknown policy.
    """
    return plan_offload(schedule, policy, Costs(), MemCosts(), OffloadCosts())


@dataclass
class _Copy:
    """One storage sent to the host."""

    storage: torch.UntypedStorage
    nbytes: int
    host: HostBuffer
    copy_out: CopyEvent
    copy_in: CopyEvent | None = None
    released: bool = False
    """The device bytes are gone (freed, or poisoned in poison mode)."""


@dataclass
class StepMemory:
    """What one step kept on this rank's device, in bytes."""

    peak_bytes: int = 0
    """Maximum resident activation bytes over the step's samples."""
    forward_bytes: dict[Key, int] = field(default_factory=dict)
    """Bytes each forward (stage, mb) kept for its backward."""
    weight_bytes: dict[Key, int] = field(default_factory=dict)
    """Bytes each split backward kept for its W (M_W)."""
    offloaded_bytes: int = 0
    """Bytes copied to the host (and back)."""
    peak_with_held: int = 0
    """Maximum of resident activation bytes plus what `ActivationOffloader.held`
    reports (stp.train: the DP reductions' gradient copies in flight), over the same
    samples and those the holder asks for (`sample`)."""


class ActivationOffloader:
    """Tracks, offloads and reloads the saved activations of one pipeline rank.

    `stages`: this rank's stages, each with `kept_tensors(mb)` (and optionally
    `shared_tensors()`). `plan`: the schedule's offload plan (an empty plan
    only measures). The executor calls `start`, then around every compute
    action `before_action`, and around each of its passes `before_pass` /
    `after_pass`, then `finish`.

    `poison=True` (for tests): instead of freeing the device bytes, overwrite
    them with 0xFF (NaN in floating point, -1 in integers), so any read of an
    offloaded activation before its reload shows in the results.
    """

    def __init__(
        self,
        schedule: Schedule,
        pp_rank: int,
        stages: Mapping[int, Any],
        plan: OffloadPlan,
        *,
        device: torch.device | str = "cpu",
        copier: Copier | None = None,
        poison: bool = False,
    ) -> None:
        for s, st in stages.items():
            if kept_tensors(st) is None:
                raise ValueError(
                    f"stage {s} ({type(st).__name__}) has no kept_tensors(mb); activation "
                    "offload and memory accounting need it (stp.models.ModelStage has it)"
                )
        self.schedule, self.pp_rank = schedule, pp_rank
        self.stages = dict(stages)
        self.device = torch.device(device)
        mine = set(schedule.stages_of(pp_rank))
        self.reload_at: dict[int, list[Key]] = {}
        for key, pos in sorted(plan.reload_at.items()):
            if key[0] in mine:
                self.reload_at.setdefault(pos, []).append(key)
        self.offloaded_keys = {k for ks in self.reload_at.values() for k in ks}
        if copier is None:
            copier = CudaCopier(self.device) if self.device.type == "cuda" else HostCopier()
        self.copier = copier
        self.poison = poison
        self.held: Callable[[], int] | None = None
        """Bytes something else holds on the device now, sampled with the activations
        (`StepMemory.peak_with_held`); None: nothing."""
        self._reset()

    # -- the executor's calls ---------------------------------------------------------

    def start(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
        """A new step; the step's data is never offloaded nor counted."""
        self._reset()
        for t in (*inputs, *targets):
            s = t.untyped_storage()
            self._data[id(s)] = s

    def before_action(self, action: Action) -> None:
        """Issue the reloads planned before this action of the rank's list."""
        idx = self._next_action
        acts = self.schedule.actions[self.pp_rank]
        assert idx < len(acts) and acts[idx] == action, (
            f"offload: action {action} out of order (expected #{idx} of rank {self.pp_rank})"
        )
        self._next_action += 1
        for key in self.reload_at.get(idx, ()):
            self._reload(key)
        self._poll()

    def before_pass(self, p: Pass) -> None:
        """A backward waits until its activations are back (reloading them now if
        its planned reload was not reached)."""
        key = (p.stage, p.mb)
        if p.kind in (Kind.B, Kind.BW) and key in self._out:
            self._reload(key)
            for c in self._out.pop(key):
                if c.copy_in is not None:
                    self.copier.wait(c.copy_in)
                self._inflight.append(c)  # its host buffer lives until its copies end
            self._reloading.discard(key)

    def after_pass(self, p: Pass) -> None:
        """Record what a forward keeps (offloading it if planned); forget what a
        backward released, record what a B keeps for its W."""
        key = (p.stage, p.mb)
        if p.kind is Kind.F:
            self._register(key)
            self._sample()  # counted until its copy out ends, as in the simulator
            if key in self.offloaded_keys:
                self._offload(key)
        elif p.kind in (Kind.B, Kind.BW):
            self._drop(self._fwd.pop(key, {}), key)
            if p.kind is Kind.B:
                kept = self.stages[p.stage].kept_tensors(p.mb)
                reg = self._collect(kept, self._shared_ids(p.stage))
                self._wgt[key] = reg
                self._add(reg)
                self.memory.weight_bytes[key] = sum(s.nbytes() for s in reg.values())
        else:
            self._drop(self._wgt.pop(key, {}), None)
        self._poll()
        self._sample()

    def finish(self) -> StepMemory:
        """End of step: wait for every copy, check every activation came back."""
        for c in (*self._inflight, *(c for cs in self._out.values() for c in cs)):
            self.copier.synchronize(c.copy_out)
            if c.copy_in is not None:
                self.copier.synchronize(c.copy_in)
        self._poll()
        if self._out:
            raise RuntimeError(
                f"offload: activations of (stage, mb) {sorted(self._out)} were offloaded "
                "and never reloaded"
            )
        self._inflight.clear()
        return self.memory

    def resident_bytes(self) -> int:
        """Activation bytes now on the device for every microbatch of this rank
        (kept up to date at every registration, release and reload)."""
        return self._now

    def recount(self) -> int:
        """`resident_bytes()` summed afresh from the live storages (a check)."""
        seen: set[int] = set()
        total = 0
        for reg in (*self._fwd.values(), *self._wgt.values()):
            for sid, s in reg.items():
                if sid not in seen and sid not in self._gone:
                    seen.add(sid)
                    total += s.nbytes()
        return total

    # -- bookkeeping -------------------------------------------------------------------

    def _reset(self) -> None:
        self.memory = StepMemory()
        self._next_action = 0
        self._data: dict[int, torch.UntypedStorage] = {}
        self._fwd: dict[Key, dict[int, torch.UntypedStorage]] = {}  # forward -> its storages
        self._wgt: dict[Key, dict[int, torch.UntypedStorage]] = {}  # B -> what W needs
        self._refs: dict[int, int] = {}  # storage id -> registries holding it
        self._size: dict[int, int] = {}  # storage id -> bytes when registered
        self._owner: dict[int, Key] = {}  # storage id -> the forward that kept it first
        self._shared: set[int] = set()  # kept by two forwards: never offloaded
        self._out: dict[Key, list[_Copy]] = {}  # offloaded, backward not yet reached
        self._reloading: set[Key] = set()
        self._inflight: list[_Copy] = []  # host buffers whose copies may still run
        self._gone: set[int] = set()  # storage ids whose device bytes are released
        self._now = 0

    def _shared_ids(self, stage: int) -> set[int]:
        """Storages every microbatch of `stage` uses: parameters, shared tables."""
        return {id(t.untyped_storage()) for t in shared_tensors(self.stages[stage])}

    def _collect(
        self, tensors: Iterable[torch.Tensor], skip: set[int]
    ) -> dict[int, torch.UntypedStorage]:
        """Device storages of `tensors` that belong to a microbatch, keyed by
        identity (a storage's Python object stays the same while we hold it)."""
        out: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t.device.type != self.device.type:
                continue
            s = t.untyped_storage()
            sid = id(s)
            if s.nbytes() and sid not in self._data and sid not in skip:
                out[sid] = s
        return out

    def _register(self, key: Key) -> None:
        kept = list(self.stages[key[0]].kept_tensors(key[1]))
        roots = [t for t in kept if t.grad_fn is not None]
        reg = self._collect([*kept, *graph_saved(roots)], self._shared_ids(key[0]))
        for sid, s in reg.items():
            other = self._owner.setdefault(sid, key)
            if other != key:
                if any(c.storage is s for c in self._out.get(other, ())):
                    raise RuntimeError(
                        f"offload: forward {key} uses a storage that forward {other} kept "
                        "and offloaded: it was not that microbatch's own"
                    )
                self._shared.add(sid)
        self._fwd[key] = reg
        self._add(reg)
        self.memory.forward_bytes[key] = sum(s.nbytes() for s in reg.values())

    def _add(self, reg: dict[int, torch.UntypedStorage]) -> None:
        for sid, s in reg.items():
            n = self._refs.get(sid, 0)
            if n == 0:
                self._size[sid] = s.nbytes()
                self._now += self._size[sid]
            self._refs[sid] = n + 1

    def _drop(self, reg: dict[int, torch.UntypedStorage], key: Key | None) -> None:
        for sid in reg:
            if key is not None and self._owner.get(sid) == key:
                del self._owner[sid]
            n = self._refs[sid] - 1
            if n:
                self._refs[sid] = n
                continue
            del self._refs[sid]
            size = self._size.pop(sid)
            if sid not in self._gone:
                self._now -= size

    def _offload(self, key: Key) -> None:
        copies = []
        for sid, s in self._fwd[key].items():
            if sid in self._shared or not s.resizable():
                continue  # stays resident (and counted)
            host, event = self.copier.to_host(s)
            copies.append(_Copy(s, s.nbytes(), host, event))
            self.memory.offloaded_bytes += s.nbytes()
        self._out[key] = copies

    def _release(self, c: _Copy) -> None:
        """The copy out has ended: the device bytes may go."""
        if self.poison:
            byte_view(c.storage).fill_(0xFF)
        else:
            c.storage.resize_(0)
        c.released = True
        self._gone.add(id(c.storage))
        self._now -= c.nbytes

    def _reload(self, key: Key) -> None:
        if key not in self._out or key in self._reloading:
            return
        self._reloading.add(key)
        for c in self._out[key]:
            if not c.released:
                # The copy out may still be reading: the device bytes stay, nothing
                # comes back, and the host buffer lives until that copy ends.
                continue
            if not self.poison:
                c.storage.resize_(c.nbytes)  # allocated on the compute stream
            c.copy_in = self.copier.to_device(c.storage, c.host)
            self._gone.discard(id(c.storage))
            self._now += c.nbytes
        self._sample()  # counted from the start of the copy in, as in the simulator

    def _poll(self) -> None:
        """Free device storages whose copy out ended; drop host buffers whose
        copies ended."""
        for key, copies in self._out.items():
            if key not in self._reloading:
                for c in copies:
                    if not c.released and c.copy_out.query():
                        self._release(c)
        self._inflight = [
            c for c in self._inflight
            if not (c.copy_out.query() and (c.copy_in is None or c.copy_in.query()))
        ]

    def sample(self) -> None:
        """Sample the resident bytes now (after every pass; the holder of `held` calls
        it when what it holds grows between passes)."""
        self._sample()

    def _sample(self) -> None:
        self.memory.peak_bytes = max(self.memory.peak_bytes, self._now)
        held = self.held() if self.held is not None else 0
        self.memory.peak_with_held = max(self.memory.peak_with_held, self._now + held)
