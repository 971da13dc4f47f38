"""The sharded optimizer: ZeRO stage 1, as Megatron-LM's distributed optimizer runs it.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv 1910.02054), section 5.1: the optimizer states
(here the fp32 master weights too) are partitioned across the N_d
data-parallel ranks, each rank updating only its partition. Per rank, in
a 16-bit run, model states fall from 16 Psi to 4 Psi + 12 Psi / N_d bytes
(stp's main grads are fp32, so 6 Psi + 12 Psi / N_d; `stp memory`).

The layout, as torch FSDP2 lays out its Shard(0) parameters: each local
parameter (this rank's TP box of it) is cut along dim 0 into dp chunks of
c = ceil(rows / dp) rows, the last ones short or empty, and the flat buffers
are rank-major, every parameter's chunk at the same offset in every rank's
segment of S elements:

    flat  | r0: p1[0:c1] p2[0:c2] .. | r1: p1[c1:2c1] p2[c2:2c2] .. | ..
           <------------- S ------------>

so that one reduce-scatter of the packed gradients hands each rank exactly
its chunks (summed; divided by dp here), and one all-gather of the updated
chunks (in the model's dtype) rebuilds every parameter. A subset (a stage's
parameters: its reduce-scatter during the backward, stp.train.step.grad_sync; its
all-gather before its next forward, stp.train.step.param_gather) is packed by a
layout of its own over the same rows. A chunk is a box of
the full-model tensor (rows at an offset inside the parameter's TP box), so
checkpoints save and load it through the same mechanism as TP shards
(stp.train.checkpoint.shards, stp.train.checkpoint.sharded). The layout's code is
stp.train.step.shard_layout.

What the optimizer steps, per parameter, is this rank's chunk: an fp32 master
shard in a 16-bit run; in a float32 / float64 run a view of the model
parameter's own rows (the weights are the masters: no copy, as `stp
memory` counts it). Its `.grad` is a view of the reduce-scatter's output.
The main grads (fp32, every element) stay: that is stage 1; their sum over
microbatches is unchanged (stp.train.step.precision). In a 16-bit run they are
kept packed, each stage's in a buffer of its own in the rank-major layout of
that stage's parameters (`group_main_grads`, called by stp.train.step.grad_sync):
a W adds its bf16 gradient straight to its chunks there (`ShardLayout.add`),
and the stage's reduce-scatter reads that buffer, where it would otherwise
pack a copy of whole main grads (the copy's bytes, a stage's gradients in
fp32, held during the last backwards). The parameters a shared sum touches
stay whole: the sum needs whole tensors.

Clipping stays exact: a shard is counted in the global norm by the same
rule as the whole tensor (stp.train.step.clip), its key extended by its rows, so
every element is counted once across DP shards and TP replicas.

With expert parallelism (stp.runtime.mesh) an EP rank's experts are
replicated over its expert-data-parallel group only (dp / ep ranks), so they
form a second section with a layout of its own over that group: its own
reduce-scatter (divided by dp all the same, each expert gradient already
holding its EP group's tokens) and all-gather. The dense parameters are the
first section, over the DP group, as without experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.train.step.in_flight import InFlight
from stp.train.step.precision import Precision
from stp.train.step.shard_layout import ShardLayout, row_box

__all__ = ["DPGroup", "ShardedPrecision"]

Collective = Callable[..., Any]
"""`run(action, peers, fn, *args, **kw)`: stp.train.step.grad_sync.collective on this rank."""


@dataclass(frozen=True)
class DPGroup:
    """The data-parallel ranks the optimizer is sharded over, and how to reach them."""

    size: int
    rank: int
    """This rank's index in the group (its DP coordinate)."""
    group: Any
    """The torch.distributed process group (None: the world)."""
    run: Collective
    """Runs a collective, a backend error raised as the rank error it is."""
    peers: str = "a DP peer"
    """Who a collective waits on, as error messages name it."""
    mean_over: int | None = None
    """What the summed gradients are divided by (None: size; experts: dp)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"DP rank {self.rank} is not in [0, {self.size})")

    @property
    def divisor(self) -> int:
        return self.size if self.mean_over is None else self.mean_over


class _Section:
    """Parameters sharded over one group: their indices in the precision's lists, the
    layout of their shapes over the group, this rank's segment of their gradients."""

    def __init__(self, group: DPGroup, index: list[int], shapes: Sequence[torch.Size],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.group, self.index = group, index
        self.layout = ShardLayout(shapes, group.size)
        self.shard_grads = torch.zeros(self.layout.segment, dtype=dtype, device=device)


@dataclass
class _Packed:
    """Main grads kept packed (`ShardedPrecision.group_main_grads`): parameters `index`
    of `section`, rank-major in `flat` by `layout` over the section's group."""

    section: _Section
    index: list[int]
    layout: ShardLayout
    flat: torch.Tensor


class ShardedPrecision(Precision):
    """stp.train.step.precision.Precision with the optimizer's parameters sharded over DP
    (module doc). `params` and `grads()` are this rank's shards; the model's
    whole gradients are `full_grads()`; `reduce_scatter` replaces the DP
    all-reduce (whole, or a stage's parameters at a time while the pipeline still
    runs: stp.train.step.grad_sync) and `copy_to_model` all-gathers. Both are
    collectives."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], units: Iterable[Any],
                 dp: DPGroup, experts: tuple[DPGroup, frozenset[str]] | None = None) -> None:
        self.dp = dp
        self.experts = experts
        """(the expert-data-parallel group, the expert parameters' names) with expert
        parallelism (module doc); None: every parameter over `dp`."""
        super().__init__(named, units)

    def _optimizer_params(self) -> list[nn.Parameter]:
        dtypes = {p.dtype for p in self.model}
        for name, p in zip(self.names, self.model, strict=True):
            if p.dim() == 0 or not p.is_contiguous():
                raise ValueError(f"the sharded optimizer splits parameters along dim 0: "
                                 f"{name!r} is {'a scalar' if p.dim() == 0 else 'not contiguous'}")
        if len(dtypes) > 1:
            raise ValueError(f"the sharded optimizer needs one parameter dtype, got "
                             f"{sorted(str(d) for d in dtypes)}")
        self.model_dtype = next(iter(dtypes), torch.float32)
        mixed = self.mixed  # one dtype: a 16-bit model or a pure one
        self.grad_dtype = torch.float32 if mixed else self.model_dtype
        device = self.model[0].device if self.model else torch.device("cpu")
        self.main_grads: list[torch.Tensor | None] = (
            [torch.zeros_like(p, dtype=torch.float32) for p in self.model] if mixed else [])
        """Whole fp32 main grads (mixed), None where `group_main_grads` packed them."""
        self.packed: list[_Packed] = []
        self._packed_at: dict[int, tuple[_Packed, int]] = {}
        self.sections = self._sections(device)
        """The dense parameters over DP, then (expert parallelism) the experts over EDP."""
        self.layout, self.shard_grads = self.sections[0].layout, self.sections[0].shard_grads
        """The dense section's layout and this rank's segment of its reduce-scattered
        gradients (`grads()` views the segments)."""
        self._place = {i: (sec, j) for sec in self.sections for j, i in enumerate(sec.index)}
        shards = []
        for i, p in enumerate(self.model):
            start, stop = self._rows(i)
            rows = p.detach()[start:stop]  # pure: the model's own rows (no copy)
            shards.append(nn.Parameter(rows.float().clone() if mixed else rows))
        return self._with_grads(shards)

    def _sections(self, device: torch.device) -> list[_Section]:
        names = frozenset() if self.experts is None else self.experts[1]
        dense = [i for i, n in enumerate(self.names) if n not in names]
        expert = [i for i, n in enumerate(self.names) if n in names]
        groups = [(self.dp, dense)]
        if self.experts is not None:
            groups.append((self.experts[0], expert))
        return [_Section(g, index, [self.model[i].shape for i in index], self.grad_dtype,
                         device) for g, index in groups]

    def _rows(self, i: int) -> tuple[int, int]:
        """[start, stop) of parameter i's rows this rank's shard holds."""
        sec, j = self._place[i]
        return sec.layout.splits[j].rows_of(sec.group.rank)

    def _with_grads(self, shards: list[nn.Parameter]) -> list[nn.Parameter]:
        for i, shard in enumerate(shards):
            sec, j = self._place[i]
            shard.grad = sec.layout.local(sec.shard_grads, j, sec.group.rank, shard.shape)
        return shards

    def _main_grad(self, i: int) -> torch.Tensor:
        grad = self.main_grads[i]
        assert grad is not None, f"parameter {self.names[i]}'s main grad is packed"
        return grad

    @torch.no_grad()
    def group_main_grads(self, groups: Iterable[Sequence[int]]) -> list[torch.Tensor]:
        """Keep the main grads of each group of parameters (mixed; each group within one
        section) packed rank-major in a flat fp32 buffer of the group's own (module
        doc), in place of whole tensors: each W's gradient is added straight to its
        chunks there, and the group's reduce-scatter reads the buffer itself, with no
        packed copy beside the gradients. Returns the buffers."""
        if not self.mixed:
            return []
        for group in groups:
            sec = self._place[group[0]][0]
            layout = ShardLayout([self.model[i].shape for i in group], sec.group.size)
            packed = _Packed(sec, list(group), layout, torch.empty(
                sec.group.size * layout.segment, dtype=torch.float32,
                device=sec.shard_grads.device))
            layout.pack([self._main_grad(i) for i in group], packed.flat)
            for j, i in enumerate(group):
                self._packed_at[i] = (packed, j)
                self.main_grads[i] = None
            self.packed.append(packed)
        return [pk.flat for pk in self.packed]

    def _fold(self, indices: Iterable[int]) -> None:
        """main grad += model .grad (in fp32), into its packed chunks where it is packed;
        the model's .grad is dropped."""
        for i in indices:
            p = self.model[i]
            if p.grad is None:
                continue
            if i in self._packed_at:
                packed, j = self._packed_at[i]
                packed.layout.add(packed.flat, j, p.grad)
            else:
                self._main_grad(i).add_(p.grad)
            p.grad = None

    def zero_grad(self) -> None:
        """Zero the main grads (mixed; the model's own `.grad` the stages zero). The
        shards' are overwritten by each reduce-scatter."""
        for g in self.grad_buffers():
            g.zero_()

    def grad_buffers(self) -> list[torch.Tensor]:
        """The tensors holding the main grads (mixed): the whole ones and the packed
        buffers (what `stp train --json` counts as gradients)."""
        if not self.mixed:
            return self.full_grads()
        return [g for g in self.main_grads if g is not None] + [pk.flat for pk in self.packed]

    def full_grads(self, indices: Iterable[int] | None = None) -> list[torch.Tensor]:
        wanted = range(len(self.model)) if indices is None else indices
        if self.mixed:
            return [self._whole_main_grad(i) for i in wanted]
        for i in wanted:
            if self.model[i].grad is None:
                self.model[i].grad = torch.zeros_like(self.model[i])
        return [self.model[i].grad for i in wanted]  # type: ignore[misc]  # each .grad was just made a tensor

    def _whole_main_grad(self, i: int) -> torch.Tensor:
        """Parameter i's whole main grad: a copy gathered from its chunks when packed."""
        if i not in self._packed_at:
            return self._main_grad(i)
        packed, j = self._packed_at[i]
        whole = torch.empty(self.model[i].shape, dtype=torch.float32, device=packed.flat.device)
        packed.layout.unpack_one(packed.flat, j, whole)
        return whole

    def grads(self) -> list[torch.Tensor]:
        """This rank's shard of each gradient (after `reduce_scatter`: the DP mean)."""
        self._with_grads(self.params)  # an optimizer's zero_grad may have dropped them
        return [p.grad for p in self.params]  # type: ignore[misc]  # the masters' .grad are set before this is read

    def norm_keys(self, keys: list[Any]) -> list[Any]:
        """Each key with the rows of this rank's shard: two ranks hold the same shard
        (TP replicas, a tied copy) only at the same rows."""
        return [(key, self._rows(i)) for i, key in enumerate(keys)]

    def optimizer_box(self, i: int, box: Any) -> Any:
        return row_box(box, *self._rows(i))

    def reduce_scatter(self, indices: Iterable[int] | None = None, *,
                       async_op: bool = False) -> list[InFlight]:
        """The DP mean of this rank's shard of every gradient (`indices`: of those
        parameters only): the gradients packed rank-major, one reduce-scatter (sum)
        per section, divided by dp. Main grads kept packed (`group_main_grads`) are
        reduce-scattered from their buffer, one reduce-scatter per group the indices
        cover; the rest are packed into a copy first. With `async_op` the
        reduce-scatters are returned in flight (finish each); else they are
        finished. A subset has a layout of its own (each parameter's chunk the same
        rows) and its result is copied to the parameters' places in the segment:
        the sharded layout, hence checkpoints, is the same whatever the subsets.
        Collective."""
        wanted = set(range(len(self.model)) if indices is None else indices)
        flights = []
        for packed in self.packed:
            if wanted.issuperset(packed.index):
                positions = [self._place[i][1] for i in packed.index]
                flights.append(self._launch(packed.section, positions, packed.layout,
                                            packed.flat, async_op, copied=False))
                wanted.difference_update(packed.index)
        for sec in self.sections:
            positions = [j for j, i in enumerate(sec.index) if i in wanted]
            if not positions:  # no experts on this stage (nor on any peer's)
                continue
            whole = len(positions) == len(sec.index)
            layout = sec.layout if whole else ShardLayout(
                [self.model[sec.index[j]].shape for j in positions], sec.group.size)
            flat = torch.empty(sec.group.size * layout.segment, dtype=self.grad_dtype,
                               device=sec.shard_grads.device)
            layout.pack(self.full_grads([sec.index[j] for j in positions]), flat)
            flights.append(self._launch(sec, positions, layout, flat, async_op, copied=True))
        if not async_op:
            for f in flights:
                f.finish()
        return flights

    def _launch(self, sec: _Section, positions: list[int], layout: ShardLayout,
                flat: torch.Tensor, async_op: bool, *, copied: bool) -> InFlight:
        """Reduce-scatter `flat` (section positions `positions` packed by `layout`) over
        the section's group; when finished, this rank's segment divided by dp, in its
        places of the section's segment. `copied`: `flat` is a packed copy the flight
        holds (not the packed main grads themselves)."""
        g, whole = sec.group, layout is sec.layout
        out = sec.shard_grads if whole else torch.empty(layout.segment, dtype=self.grad_dtype,
                                                        device=flat.device)
        action = "DP gradient reduce-scatter"
        work = g.run(action, g.peers, dist.reduce_scatter_single, out, flat, group=g.group,
                     async_op=async_op)

        def then() -> None:
            out.div_(g.divisor)
            if not whole:
                for j, sub in zip(positions, layout.splits, strict=True):
                    dst = sec.layout.splits[j]
                    sec.shard_grads[dst.offset : dst.offset + dst.size].copy_(
                        out[sub.offset : sub.offset + sub.size])

        wait = (lambda: g.run(action, g.peers, work.wait)) if work is not None else (
            lambda: None)
        return InFlight(work, wait, then, keep=(out, flat) if copied else (out,))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Every rank's updated shards, in the model's dtype, gathered into the whole
        parameters (rounding the fp32 masters as Precision does), one all-gather per
        section. Collective."""
        self.all_gather()

    def all_gather(self, indices: Iterable[int] | None = None, *,
                   async_op: bool = False) -> list[InFlight]:
        """Gather every rank's updated shards of the parameters (`indices`: of those
        only, e.g. one stage's) into the whole model parameters: this rank's shards
        packed in the model's dtype by the subset's own rank-major layout (the
        section's when it is whole), one all-gather per section, unpacked. With
        `async_op` the all-gathers are returned in flight and the model parameters
        are written when each is finished (stp.train.step.param_gather: before the
        stage's first forward of the next step); else they are finished. The
        values are the same whatever the subsets: only copies. Collective."""
        wanted = set(range(len(self.model)) if indices is None else indices)
        flights = []
        for sec in self.sections:
            positions = [j for j, i in enumerate(sec.index) if i in wanted]
            if not positions:  # no experts on this stage (nor on any peer's)
                continue
            layout = sec.layout if len(positions) == len(sec.index) else ShardLayout(
                [self.model[sec.index[j]].shape for j in positions], sec.group.size)
            flights.append(self._gather(sec, [sec.index[j] for j in positions], layout,
                                        async_op))
        if not async_op:
            for f in flights:
                f.finish()
        return flights

    def _gather(self, sec: _Section, params: list[int], layout: ShardLayout,
                async_op: bool) -> InFlight:
        """All-gather this rank's shards of parameters `params` (of `sec`, packed by
        `layout`) over the section's group; when finished, every rank's rows copied
        into the whole parameters."""
        g = sec.group
        with torch.no_grad():
            mine = torch.zeros(layout.segment, dtype=self.model_dtype,
                               device=sec.shard_grads.device)
            for k, i in enumerate(params):
                shard = self.params[i]
                layout.local(mine, k, g.rank, shard.shape).copy_(shard)
        every = torch.empty(g.size * layout.segment, dtype=self.model_dtype, device=mine.device)
        action = "parameter all-gather"
        work = g.run(action, g.peers, dist.all_gather_single, every, mine, group=g.group,
                     async_op=async_op)

        @torch.no_grad()  # finished inside the next step's autograd-recording run
        def then() -> None:
            layout.unpack(every, [self.model[i] for i in params])

        wait = (lambda: g.run(action, g.peers, work.wait)) if work is not None else (
            lambda: None)
        return InFlight(work, wait, then, keep=(mine, every))
