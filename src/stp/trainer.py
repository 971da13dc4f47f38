"""Trainer: one object that trains a TP x PP x DP model with any stp schedule.

Mirrors the seed README (seed 001, "Run this schedule"):

    trainer = Trainer(ModelConfig(...), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      "stp", pp=2, tp=2, dp=1, microbatches=8)
    for step in range(n):
        loss = trainer.step(batch)      # same value on every rank

One `step` = one iteration over m microbatches of the global batch:

    1. every rank takes its DP replica's rows and cuts them into m microbatches;
    2. the executor runs this pipeline rank's lowered program (stp.runtime.executor);
       the last stage seeds each backward with 1/m, so .grad holds the
       gradient of the mean of microbatch means = the full-batch mean loss;
    3. gradients are averaged over DP replicas (one flat all-reduce);
    4. the optimizer steps; the loss (mean over microbatches and replicas)
       is summed over the world from the ranks holding it, so every rank
       returns the same number.

Nothing is scaled twice: 1/m once in the backward seed, 1/dp once in the
DP average.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.models import ModelConfig, build_stage, check_tp
from stp.runtime.errors import CommTimeout, RankError, first_line, is_timeout
from stp.runtime.executor import Executor
from stp.runtime.launch import init_distributed
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.offload import ActivationOffloader, StepMemory, runtime_plan
from stp.runtime.p2p import P2P
from stp.runtime.stage_api import PipelineStage
from stp.runtime.trace import Recorder, gather_spans, write_trace
from stp.schedule import Schedule, registry, validate
from stp.schedule.lower import lower

__all__ = ["Trainer", "StageBuilder", "OptimizerFactory", "make_schedule", "check_model"]

StageBuilder = Callable[..., Any]
"""`builder(stage, num_stages, *, tp_group, tp_size, tp_rank, device, dtype)` -> a
PipelineStage that also has `named_parameters()`, `shard_dim(name)`, `zero_grad()`."""
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def make_schedule(name: str, pp: int, microbatches: int | None = None) -> Schedule:
    """Generate and validate schedule `name` for pp ranks; m defaults to the
    schedule's minimum or 2 pp, whichever is larger."""
    spec = registry.get(name)
    m = microbatches if microbatches is not None else max(spec.min_microbatches(pp), 2 * pp)
    schedule = registry.generate(name, pp, m)
    validate(schedule)
    return schedule


def check_model(config: ModelConfig, tp: int, num_stages: int) -> None:
    """ValueError unless the model splits into num_stages stages of tp shards."""
    if config.num_layers < num_stages:
        raise ValueError(
            f"--layers {config.num_layers} is fewer than the schedule's {num_stages} stages; "
            f"every stage needs a layer, so use at least {num_stages} layers"
        )
    check_tp(config, tp, 0)


class Trainer:
    """Trains one model on a pp x tp x dp mesh with one schedule (see module doc).

    `model`: a `stp.models.ModelConfig` or a StageBuilder. `optimizer`: a
    factory taking this rank's parameters. `schedule`: a registry name or a
    Schedule for pp ranks. `mesh`: reuse existing process groups (else they
    are created from the world; a world of one needs no launcher). `data`:
    an iterable of (tokens, targets) global batches for `step()` without an
    argument. `hidden` is the width of stage boundary tensors (read from a
    ModelConfig). `timeout` (s) bounds every receive and collective.
    `offload`: an activation offload policy (none, stp, all, selective:X;
    stp.runtime.offload); given, even as "none", resident activation bytes
    are measured every step (`memory`, `activation_peaks()`).
    `braid`: run braided blocks unit by unit with the TP all-reduces hidden
    (stp.runtime.braid; False: the unbraided baseline). `trace`: record every
    step (`write_trace` writes the last one).
    """

    def __init__(
        self,
        model: Any,
        optimizer: OptimizerFactory | None = None,
        schedule: str | Schedule = "stp",
        *,
        pp: int = 1,
        tp: int = 1,
        dp: int = 1,
        microbatches: int | None = None,
        mesh: Mesh | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        data: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
        hidden: int | None = None,
        lookahead: int = 1,
        offload: str | None = None,
        braid: bool = True,
        trace: bool = False,
    ) -> None:
        dims = mesh.dims if mesh is not None else ParallelDims(pp, tp, dp)
        if isinstance(schedule, str):
            schedule = make_schedule(schedule, dims.pp, microbatches)
        else:
            if schedule.num_ranks != dims.pp:
                raise ValueError(
                    f"schedule {schedule.name} has {schedule.num_ranks} ranks, not pp={dims.pp}"
                )
            validate(schedule)
        if isinstance(model, ModelConfig):
            check_model(model, dims.tp, schedule.num_stages)
            hidden = model.hidden
            builder = functools.partial(build_stage, model)
        else:
            if hidden is None:
                raise ValueError("a stage builder needs hidden= (width of boundary tensors)")
            builder = model
        if mesh is None:
            if not dist.is_initialized():
                if dims.world_size != 1:
                    raise ValueError(
                        f"a {dims.world_size}-rank mesh needs torch.distributed initialised "
                        "(start under torchrun, or use `stp train`)"
                    )
                init_distributed(
                    timeout=timeout, device=None if device is None else torch.device(device)
                )
            mesh = Mesh.from_world(dims, device=device, timeout=timeout)
        self.mesh, self.dims, self.schedule = mesh, dims, schedule
        self.dtype, self.hidden, self.timeout = dtype, hidden, timeout
        self.device = mesh.device if device is None else torch.device(device)
        c = mesh.coord
        self.stages: dict[int, Any] = {
            s: builder(
                s, schedule.num_stages, tp_group=mesh.tp_group, tp_size=dims.tp, tp_rank=c.tp,
                device=self.device, dtype=dtype,
            )
            for s in schedule.stages_of(c.pp)
        }
        for st in self.stages.values():
            if not isinstance(st, PipelineStage):
                raise ValueError(
                    f"the stage builder returned a {type(st).__name__}, not a PipelineStage "
                    "(stp.runtime.stage_api)"
                )
        self.parameters = [p for st in self.stages.values() for p in st.parameters()]
        factory = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        self.optimizer = factory(self.parameters)
        p2p = None
        if dims.pp > 1:
            p2p = P2P(mesh.pp_group, mesh.ranks["pp"], schedule.num_stages,
                      timeout=timeout, where=mesh.describe())
        # activation offload (stp.runtime.offload): plan checked before any step
        self.offloader = None if offload is None else ActivationOffloader(
            schedule, c.pp, self.stages, runtime_plan(schedule, offload), device=self.device
        )
        self.executor = Executor(
            lower(schedule, lookahead=lookahead), c.pp, self.stages, p2p,
            boundary_shape=(1, 1, hidden), dtype=dtype, device=self.device,
            where=mesh.describe(),
            collective_peers=f"the TP group (global ranks {mesh.ranks['tp']})",
            offload=self.offloader,
            braid=braid,  # braided blocks (stp.runtime.braid); trace: stp.runtime.trace
            recorder=Recorder(mesh.rank, [schedule.chunk_of(s) for s in range(
                schedule.num_stages)]) if trace else None,
        )
        self.holds_loss = schedule.stage_to_rank[-1] == c.pp
        self._data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = (
            iter(data) if data is not None else None
        )
        self.steps_done = 0

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def memory(self) -> StepMemory | None:
        """This rank's activation bytes in the last step (None without `offload`)."""
        return None if self.offloader is None else self.offloader.memory

    def activation_peaks(self) -> list[int] | None:
        """Peak resident activation bytes of the last step on every global rank
        (collective: every rank calls it); None without `offload`."""
        if self.offloader is None:
            return None
        peaks: list[Any] = [None] * self.dims.world_size
        self._collective("memory gather", "the world", dist.all_gather_object, peaks,
                         self.offloader.memory.peak_bytes)
        return [int(p) for p in peaks]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(global name, local tensor) of every parameter this rank holds."""
        for st in self.stages.values():
            yield from st.named_parameters()

    # -- one iteration ------------------------------------------------------------

    def step(self, batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
        """Run one iteration on the global batch (tokens, targets) [B, s] and
        step the optimizer; B must split into dp x m equal microbatches.
        Returns the mean loss, the same on every rank."""
        if batch is None:
            if self._data is None:
                raise ValueError("step() without a batch needs Trainer(..., data=...)")
            batch = next(self._data)
        tokens, targets = batch
        if tokens.shape != targets.shape or tokens.dim() != 2:
            raise ValueError(
                f"batch needs tokens and targets of one shape [B, s], got {tuple(tokens.shape)} "
                f"and {tuple(targets.shape)}"
            )
        from stp.runtime.data import split_batch

        d, m, c = self.dims, self.num_microbatches, self.mesh.coord
        inputs = [t.to(self.device) for t in split_batch(tokens, d.dp, c.dp, m)]
        tgts = [t.to(self.device) for t in split_batch(targets, d.dp, c.dp, m)]
        for st in self.stages.values():
            st.zero_grad()
        losses = self.executor.run(inputs, tgts, boundary_shape=(*inputs[0].shape, self.hidden))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.holds_loss and c.tp == 0:
            total += sum(float(v) for v in losses.values()) / (m * d.dp)
        self._collective("loss all-reduce", "the world", dist.all_reduce, total)
        if d.dp > 1:
            self._reduce_dp_grads()
        self.optimizer.step()
        self.steps_done += 1
        return float(total)

    def write_trace(self, path: str, meta: dict[str, object] | None = None) -> None:
        """Write the last step's measured trace of every rank to `path` on global
        rank 0 (stp.runtime.trace; needs `trace=True`). Collective."""
        rec = self.executor.recorder
        if rec is None:
            raise ValueError("write_trace needs Trainer(..., trace=True)")
        spans = gather_spans(rec)
        if spans is not None:
            pp_of = {r: self.dims.coord_of(r).pp for r in range(self.dims.world_size)}
            write_trace(path, spans, self.schedule, pp_of, meta)

    def _reduce_dp_grads(self) -> None:
        """Average gradients over DP replicas in one flat all-reduce."""
        grads = []
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        group = self.mesh.dp_group
        what = f"the DP group (global ranks {self.mesh.ranks['dp']})"
        self._collective("DP gradient all-reduce", what, dist.all_reduce, flat, group=group)
        flat /= self.dims.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _collective(
        self, action: str, peers: str, fn: Callable[..., Any], *args: Any, **kw: Any
    ) -> Any:
        try:
            return fn(*args, **kw)
        except RuntimeError as e:
            first = first_line(e)
            cls = CommTimeout if is_timeout(e) else RankError
            where = self.mesh.describe()
            raise cls(f"waiting on {peers}: {first}", where=where, action=action) from e

    # -- gathering ------------------------------------------------------------------

    def full_state_dict(self, *, grads: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters (or with grads=True their gradients) on
        global rank 0, on the CPU, under the reference's names: TP shards
        concatenated along shard_dim, stages gathered over PP. None elsewhere.
        Collective: every rank must call it."""
        local: dict[str, torch.Tensor] = {}
        tp_group = self.mesh.tp_group
        for st in self.stages.values():
            for name, p in st.named_parameters():
                t = p.grad if grads else p
                t = torch.zeros_like(p) if t is None else t.detach()
                dim = st.shard_dim(name)
                if dim is not None and self.dims.tp > 1:
                    parts = [torch.empty_like(t) for _ in range(self.dims.tp)]
                    self._collective(
                        "state gather", "the TP group", dist.all_gather, parts, t.contiguous(),
                        group=tp_group,
                    )
                    t = torch.cat(parts, dim=dim)
                local[name] = t.cpu().clone()
        c = self.mesh.coord
        payload = local if c.tp == 0 and c.dp == 0 else {}
        out: list[Any] | None = [None] * self.dims.world_size if self.mesh.rank == 0 else None
        self._collective("state gather", "the world", dist.gather_object, payload, out, dst=0)
        if out is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in out:
            merged.update(part)
        return dict(sorted(merged.items()))
