"""A step's gradient and loss collectives, in the one order every rank runs them.

During the backward, with the overlap on (the default; Megatron-LM's
`--overlap-grad-reduce`, FSDP's reduce-scatter under the backward): as soon
as a stage's gradients on this rank are final for the step (its last W, or
its last full backward; the executor tells `stage_final`, stp.runtime.
executor), that stage's DP reduction is launched asynchronously, so it runs
under the compute of the passes still to come:

    compute:  .. B(3) W(3) stage 1 | F(7) B(7) W(7) stage 0 |
    DP:                             [AR stage 1 ...........][AR stage 0]
                                                            ^ pipeline drained

Off, every reduction runs in step 3 below, after the pipeline drains.

After the executor's backward each rank holds its own gradients and, on the
ranks of the last stage, its microbatches' losses. `GradSync.after_backward`
then runs, on every rank:

    0. it waits for the reductions in flight (and uses their results);
    1. the shared-gradient sum: tied embedding / head copies, replicated kv
       heads, sequence-parallel norm gains (the decoder's SharedGrads). The sums
       commute with the DP average (both are linear), so with the all-reduce
       the stages already averaged are summed here; the sharded optimizer's
       shards are not whole tensors, so there the parameters a sum touches
       (`SharedGrads.names`; every parameter when the sum does not say) wait
       for step 3 and are reduced after their sum, as without the overlap;
    2. the loss sum over the world: the mean over microbatches and replicas,
       so every rank returns the same number;
    3. the DP average of the gradients not reduced yet (fp32 main grads in
       mixed precision: a stage's are folded into them before its reduction),
       one flat all-reduce; with the sharded optimizer (stp.train.step.zero) one
       reduce-scatter instead, each rank keeping the mean of its shard. With
       expert parallelism an expert's gradient already holds the tokens of
       its whole EP group: it is summed over the expert's replicas (the
       expert-data-parallel group, dp / ep ranks) and divided by dp, so it is
       the mean over every replica's microbatches as a dense one;
    4. the global gradient norm's all-reduce (stp.train.step.clip), over the
       gradients the optimizer reads (with sharding: each rank's shards).

The optimizer then steps (stp.train.step.precision); with the sharded optimizer
its parameter all-gather follows the step, exposed, or with
`overlap_param_gather` under the next step's forwards (stp.train.step.param_gather).

In a 16-bit run the fp32 main grads are reduced where they lie (Megatron-LM's
contiguous gradient buffer): with the all-reduce each stage's are views of
one flat buffer (its experts' of another; `Precision.group_main_grads`),
all-reduced in place; with the sharded optimizer they are kept packed
rank-major, as its reduce-scatter reads them (stp.train.step.zero), and only the
stage's segment of the result is held. The `late` parameters stay whole and,
like a float32 / float64 run's gradients (the model's own `.grad`, which its
units create), are reduced from a flat copy (the sharded optimizer's: packed
rank-major). A copy in flight is released when its reduction is seen
complete at the next stage's launch, or at the latest in `after_backward`
(`stp memory`'s estimate counts what the copies add to the activations' peak
in its buffers, taking the latest: stp.costmodel.memory).

There is no gradient accumulation across executor runs: a step is one run
over its m microbatches, whose gradients the stages sum as they go.

Every collective goes through `collective`, so a backend error becomes one
rank error the one way (stp.runtime.errors.wrap): a lost DP peer is reported
as lost, a stalled one as a timeout, both naming this rank, the collective
and the group it waited on; an asynchronous one the same, when waited for.
The DP reductions are recorded in the trace (`stp train --trace`, the dp
lane of `stp draw --measured`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from stp.runtime.errors import RankError, wrap
from stp.runtime.mesh import Mesh
from stp.runtime.stage_api import expert_names
from stp.train.checkpoint.shards import box_of, norm_key
from stp.train.step.clip import counted_mask, global_norm
from stp.train.step.in_flight import InFlight
from stp.train.step.precision import Precision
from stp.train.step.zero import ShardedPrecision

__all__ = ["GradSync", "SharedSum", "collective", "WORLD"]

SharedSum = Callable[[dict[str, torch.Tensor]], None]
"""Sums the gradients of parameters held in several places, in place, by global name."""

WORLD = "a rank in the world"
"""Who a collective over the whole world waits on, as error messages name it."""


def collective(mesh: Mesh, action: str, peers: str, fn: Callable[..., Any], *args: Any,
               **kw: Any) -> Any:
    """`fn(*args, **kw)`, a torch.distributed collective this rank runs as `action`
    waiting on `peers`; a backend error is raised as the rank error it is."""
    try:
        return fn(*args, **kw)
    except RankError:
        raise
    except RuntimeError as e:
        raise wrap(e, where=mesh.describe(), action=action, peers=peers) from e


class GradSync:
    """The gradient and loss collectives of one rank's steps (see the module doc).

    `stages`: this rank's stages by global index; `shared`: sums, in place,
    the gradients (by global name) of parameters held in several places (the
    decoder's SharedGrads; None: a user's stage builder); `holds_loss`: this
    pipeline rank runs the last stage; `device`: where this rank's tensors
    live; `overlap`: launch each stage's DP reduction as soon as the executor
    says its gradients are final (`stage_final`; nothing to do at dp=1);
    `recorder` (stp.runtime.trace): records the DP reductions. Building it
    is collective: the ranks agree on which of them counts each gradient in
    the norm.
    """

    def __init__(self, mesh: Mesh, precision: Precision, stages: Mapping[int, Any], *,
                 shared: SharedSum | None, holds_loss: bool, device: torch.device,
                 overlap: bool = False, recorder: Any = None) -> None:
        self.mesh, self.precision, self.shared = mesh, precision, shared
        self.holds_loss, self.device = holds_loss, device
        self.collective = functools.partial(collective, mesh)
        """`collective(action, peers, fn, *args, **kw)` on this rank (module function)."""
        experts = {n for st in stages.values() for n in expert_names(st)}
        self.expert_index = [i for i, n in enumerate(precision.names) if n in experts]
        """Which of the precision's parameters are experts held by this EP rank only."""
        self.counted = self._norm_mask(stages)
        """Which of this rank's gradients it adds to the global norm (stp.train.step.clip)."""
        self.overlap = overlap and mesh.dims.dp > 1
        """Each stage's DP reduction is launched by `stage_final` (module doc)."""
        self.recorder = recorder
        self.stage_params = _stage_params(stages, len(precision.names))
        """{stage: indices of its parameters in the precision's lists}."""
        self.late = self._late_indices()
        """Parameters reduced after the shared sum even with the overlap (module doc)."""
        self.flat_grads = self._group_main_grads()
        """(parameter indices, the flat buffer their main grads view): each stage's dense
        parameters, then its experts, reduced in place (module doc)."""
        self._in_flight: list[InFlight] = []
        self._reduced: set[int] = set()
        self.extra_values: list[float] = []
        """What the last `after_backward`'s `extra` held, read with its loss and norm."""
        self.sampler: Callable[[], None] | None = None
        """Called after each launch: the activation offloader's `sample`, so the copies'
        bytes (`held_bytes`) are measured with the activations (stp.train.run.setup)."""

    def _group_main_grads(self) -> list[tuple[list[int], torch.Tensor]]:
        """Mixed precision at dp > 1: each stage's dense main grads in one buffer, its
        experts' in another (the groups a stage's reduction covers whole; `late`
        parameters, reduced after the shared sum, stay whole). The all-reduce's are
        returned (reduced in place here); the sharded optimizer keeps its own packed
        (its reduce-scatter reads them, stp.train.step.zero)."""
        p = self.precision
        if not p.mixed or self.mesh.dims.dp == 1:
            return []
        experts = set(self.expert_index)
        groups = [g for idx in self.stage_params.values()
                  for g in ([i for i in idx if i not in experts and i not in self.late],
                            [i for i in idx if i in experts and i not in self.late])
                  if g]
        buffers = p.group_main_grads(groups)
        return [] if isinstance(p, ShardedPrecision) else list(zip(groups, buffers,
                                                                   strict=True))

    def _late_indices(self) -> frozenset[int]:
        if not isinstance(self.precision, ShardedPrecision) or self.shared is None:
            return frozenset()
        names = getattr(self.shared, "names", None)
        every = range(len(self.precision.names))
        return frozenset(every if names is None else
                         (i for i in every if self.precision.names[i] in names))

    def _norm_mask(self, stages: Mapping[int, Any]) -> list[bool]:
        tp, tp_rank = self.mesh.dims.tp, self.mesh.coord.tp
        keys = [norm_key(st, n, box_of(st, n, p, tp, tp_rank))
                for st in stages.values() for n, p in st.named_parameters()]
        gather = None if self.mesh.dims.world_size == 1 else functools.partial(
            self.collective, "gradient keys gather", WORLD, dist.all_gather_object)
        return counted_mask(self.precision.norm_keys(keys), rank=self.mesh.rank, gather=gather)

    def start_step(self) -> None:
        """Forget the last step's reductions (call before the executor runs)."""
        self.finish_reductions()
        self._reduced = set()

    def stage_final(self, stage: int) -> None:
        """The executor's `grads_final`: `stage`'s gradients on this rank are final for
        the step; launch its DP reduction (the parameters not in `late`)."""
        if not self.overlap:
            return
        idx = [i for i in self.stage_params[stage] if i not in self.late]
        if self.precision.mixed:
            self.precision.fold(idx)  # into the fp32 main grads first
        self._finish_completed()  # their flat copies go before this stage's come
        self._in_flight += self._reduce(idx, stage, async_op=True)
        if self.sampler is not None:
            self.sampler()

    def held_bytes(self) -> int:
        """Bytes of the buffers the reductions in flight hold (each storage once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for f in self._in_flight for t in f.keep}
        return sum(storages.values())

    def _finish_completed(self) -> None:
        """Finish the oldest reductions in flight that are done (in launch order)."""
        while self._in_flight and self._in_flight[0].completed():
            self._in_flight.pop(0).finish()

    def finish_reductions(self) -> None:
        """Wait for the reductions in flight and use their results, oldest first."""
        flights, self._in_flight = self._in_flight, []
        for f in flights:
            f.finish()

    def after_backward(self, losses: Mapping[int, torch.Tensor], microbatches: int,
                       valid_ratio: float,
                       extra: torch.Tensor | None = None) -> tuple[float, float]:
        """(the step's mean loss, the global gradient norm), both the same on every
        rank, with the gradients summed where shared and averaged over DP.
        `losses`: this rank's microbatch mean losses (empty off the last stage);
        `valid_ratio`: the global batch's share of counted targets (each
        microbatch's mean is over its own valid targets). Both figures are read
        from the device at once, the step's one host sync; `extra` (a 1-d tensor on
        this rank's device, e.g. the auxiliary losses' reduced figures) is read in
        the same sync and left in `self.extra_values`. Collective."""
        self.finish_reductions()
        self.sum_shared()
        loss = self.world_loss_tensor(losses, microbatches, valid_ratio)
        rest = [i for i in range(len(self.precision.names)) if i not in self._reduced]
        if rest:
            self._reduce(rest, None, async_op=False)
        self._reduced = set()
        norm = self.grad_norm_tensor().to(loss.device)
        parts = [loss.reshape(1), norm.reshape(1)]
        if extra is not None:
            parts.append(extra.to(loss))
        values = torch.cat(parts).tolist()  # the one host sync of a step
        self.extra_values = values[2:]
        return values[0], values[1]

    def _reduce(self, idx: list[int], stage: int | None, *, async_op: bool) -> list[InFlight]:
        """The DP reduction of parameters `idx` (of `stage`; None: whatever is left):
        the sharded optimizer's reduce-scatter, or the all-reduce. Finished unless
        `async_op`. Nothing at dp=1."""
        self._reduced.update(idx)
        if not idx:
            return []
        if isinstance(self.precision, ShardedPrecision):
            flights, kind = self.precision.reduce_scatter(idx, async_op=True), "DP-RS"
        elif self.mesh.dims.dp > 1:
            flights, kind = self.average_dp(idx, async_op=True), "DP-AR"
        else:
            return []
        if self.recorder is not None:
            what = "left" if stage is None else f"stage {stage}"
            for f in flights:
                f.watched = self.recorder.reduction(f.work, f"{kind} {what}", kind,
                                                    min(self.stage_params) if stage is None
                                                    else stage, f.launched)
        if not async_op:
            for f in flights:
                f.finish()
        return flights

    def sum_shared(self) -> None:
        """Sum the gradients of parameters held in more than one place."""
        if self.shared is not None:
            p = self.precision
            names = getattr(self.shared, "names", None)  # None: it may touch any
            idx = [i for i, n in enumerate(p.names) if names is None or n in names]
            grads = dict(zip([p.names[i] for i in idx], p.full_grads(idx), strict=True))
            self.collective("tied / replicated gradient sum", "a rank sharing parameters",
                            self.shared, grads)

    def world_loss(self, losses: Mapping[int, torch.Tensor], microbatches: int,
                   valid_ratio: float, *, action: str = "loss all-reduce") -> float:
        """`world_loss_tensor`, read as a Python float. Collective."""
        return float(self.world_loss_tensor(losses, microbatches, valid_ratio, action=action))

    def world_loss_tensor(self, losses: Mapping[int, torch.Tensor], microbatches: int,
                          valid_ratio: float, *,
                          action: str = "loss all-reduce") -> torch.Tensor:
        """The global batch's mean loss from the microbatch means on the ranks holding
        the last stage (one TP rank of each counts), summed over the world: a float64
        scalar on this rank's device, not read (no host sync per microbatch)."""
        d = self.mesh.dims
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.holds_loss and self.mesh.coord.tp == 0 and losses:
            # summed one by one in float64, in the order Python's sum of floats did
            mine = torch.zeros((), dtype=torch.float64, device=self.device)
            for v in losses.values():
                mine += v.detach().to(mine)
            total += mine / (microbatches * d.dp) * valid_ratio
        self.collective(action, WORLD, dist.all_reduce, total)
        return total

    def average_dp(self, indices: Iterable[int] | None = None, *,
                   async_op: bool = False) -> list[InFlight]:
        """Average the gradients (fp32 main grads in mixed precision; `indices`: of
        those parameters only) over the DP replicas (experts': over their replicas,
        module doc): each group of `flat_grads` the indices cover whole in place, the
        rest in one flat all-reduce of a copy. With `async_op` the all-reduces are
        returned in flight (finish each); else they are finished."""
        grads = self.precision.grads()
        wanted = list(range(len(grads)) if indices is None else indices)
        experts = set(self.expert_index)
        flights, done = [], set()
        for idx, flat in self.flat_grads:
            if set(idx) <= set(wanted) and _views_of(flat, [grads[i] for i in idx]):
                axis = "edp" if idx[0] in experts else "dp"
                flights.append(self._mean(flat, None, axis))
                done.update(idx)
        wanted = [i for i in wanted if i not in done]
        for axis, mine in (("dp", [i for i in wanted if i not in experts]),
                           ("edp", [i for i in wanted if i in experts])):
            if mine:
                parts = [grads[i] for i in mine]
                flights.append(self._mean(torch.cat([g.reshape(-1) for g in parts]), parts,
                                          axis))
        if not async_op:
            for f in flights:
                f.finish()
        return flights

    def _mean(self, flat: torch.Tensor, grads: list[torch.Tensor] | None,
              axis: str) -> InFlight:
        """Sum `flat` over the group of `axis` ("dp", or "edp" for experts) in one
        all-reduce launched now, to be divided by dp when finished and, when it is a
        copy of `grads`, copied back (None: `flat` is the gradients' own buffer)."""
        group, action = ((self.mesh.dp_group, "DP gradient all-reduce") if axis == "dp"
                         else (self.mesh.edp_group, "expert gradient all-reduce"))
        work, peers = None, f"a rank in {self.mesh.describe_group(axis)}"
        launched = time.perf_counter()
        if len(self.mesh.ranks[axis]) > 1:
            work = self.collective(action, peers, dist.all_reduce, flat, group=group,
                                   async_op=True)

        def then() -> None:
            flat.div_(self.mesh.dims.dp)
            offset = 0
            for g in grads or ():
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

        return InFlight(work, lambda: self.collective(action, peers, work.wait), then,  # type: ignore[union-attr]  # InFlight waits only for a work it has
                        launched, keep=() if grads is None else (flat,))

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients (stp.train.step.clip). Collective."""
        return float(self.grad_norm_tensor())

    def grad_norm_tensor(self) -> torch.Tensor:
        """`grad_norm` as a float64 scalar tensor, not read. Collective."""
        world_sum = None
        if self.mesh.dims.world_size > 1:
            world_sum = functools.partial(self.collective, "grad-norm all-reduce", WORLD,
                                          dist.all_reduce)
        return global_norm(self.precision.grads(), self.counted, world_sum)


def _views_of(flat: torch.Tensor, grads: list[torch.Tensor]) -> bool:
    """Whether `grads` are consecutive views filling `flat` (still the buffer they were
    placed in: nothing replaced a main grad since)."""
    offset, base = 0, flat.data_ptr()
    for g in grads:
        if (g.dtype != flat.dtype or not g.is_contiguous()
                or g.data_ptr() != base + offset * flat.element_size()):
            return False
        offset += g.numel()
    return offset == flat.numel()


def _stage_params(stages: Mapping[int, Any], total: int) -> dict[int, list[int]]:
    """{stage: indices of its parameters}, in the order the precision lists them
    (stage by stage, each stage's `named_parameters()`)."""
    out, offset = {}, 0
    for s, st in stages.items():
        n = sum(1 for _ in st.named_parameters())
        out[s] = list(range(offset, offset + n))
        offset += n
    assert offset == total, f"{offset} stage parameters, {total} in the precision"
    return out
