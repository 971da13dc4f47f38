"""Trainer: one object that trains a TP x PP x DP model with any stp schedule.

As the STP paper's reference code runs a schedule:

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
    4. the global gradient norm is taken over the whole model and the
       gradients clipped by it (stp.train.clip; inf/NaN: the step is skipped
       on every rank); the optimizer steps, in bf16 on fp32 master weights
       and main grads (stp.train.precision), and the LR schedule advances
       (stp.train.lr); the loss (mean over microbatches and replicas) is
       summed over the world from the ranks holding it, so every rank
       returns the same number.

`save(dir)` and `Trainer.resume(dir, ...)` write and read sharded checkpoints
that any mesh can load (stp.train.checkpoint).

Nothing is scaled twice: 1/m once in the backward seed, 1/dp once in the
DP average.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.models.family import check_text_batch
from stp.models.hf import DEFAULT_SHARD_BYTES, HFCheckpoint, agreeing_config
from stp.models.tp.layers import valid_token_ratio
from stp.runtime.errors import CommTimeout, RankError, first_line, is_timeout
from stp.runtime.executor import Executor
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.offload import ActivationOffloader, StepMemory, runtime_plan
from stp.runtime.p2p import P2P
from stp.runtime.stage_api import PipelineStage
from stp.runtime.trace import Recorder, gather_spans, write_trace
from stp.schedule import Schedule
from stp.schedule.lower import lower
from stp.train import checkpoint
from stp.train.clip import counted_mask, grad_norm
from stp.train.data import split_batch
from stp.train.families import family_of
from stp.train.gather import gather_full_state
from stp.train.lr import make_scheduler
from stp.train.precision import Precision, UpdateStats, apply_update
from stp.train.setup import (
    StageBuilder,
    TrainerOptions,
    resolve_schedule,
    stage_builder,
    world_mesh,
)
from stp.train.shards import box_of, norm_key

__all__ = ["Trainer", "TrainerOptions", "StageBuilder", "OptimizerFactory"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Trainer:
    """Trains one model on a pp x tp x dp mesh with one schedule (see module doc).

    `model`: a `stp.models.ModelConfig`, a multimodal `stp.shapes.mllm.
    MLLMConfig` (batches: pixel bytes + tokens, targets over image + text
    positions; stp.train.images) or a StageBuilder. `optimizer`: a
    factory taking this rank's parameters. `schedule`: a registry name, a
    schedule file (FILE.json / FILE.csv, as `stp search --out` writes) or a
    Schedule for pp ranks. `mesh`: reuse existing process groups (else they
    are created from the world; a world of one needs no launcher). `data`:
    an iterable of (tokens, targets) global batches for `step()` without an
    argument. `options` (TrainerOptions), or any of its fields as keywords.
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
        data: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
        options: TrainerOptions | None = None,
        init_from: str | os.PathLike[str] | None = None,
        **option_overrides: Any,
    ) -> None:
        opts = replace(options or TrainerOptions(), **option_overrides)
        dims = mesh.dims if mesh is not None else ParallelDims(pp, tp, dp)
        schedule = resolve_schedule(schedule, dims, microbatches)
        self.source = None if init_from is None else HFCheckpoint.open(init_from)
        """The Hugging Face checkpoint the weights were read from (init_from)."""
        if self.source is not None:
            model = agreeing_config(model, self.source)
        builder, hidden = stage_builder(model, opts, schedule.num_stages, dims.tp, self.source)
        mesh = mesh or world_mesh(dims, opts)
        self.mesh, self.dims, self.schedule, self.options = mesh, dims, schedule, opts
        self.dtype, self.hidden, self.timeout = opts.dtype, hidden, opts.timeout
        self.device = mesh.device if opts.device is None else torch.device(opts.device)
        c = mesh.coord
        self.stages: dict[int, Any] = {
            s: builder(
                s, schedule.num_stages, tp_group=mesh.tp_group, tp_size=dims.tp, tp_rank=c.tp,
                device=self.device, dtype=opts.dtype,
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
        self.family = family_of(model)
        """The model family of `model` (stp.train.families); None for a stage builder."""
        self.model_config = None if self.family is None else model
        self._shared = None if self.family is None else self.family.model.shared_grads(
            model, self.stages, schedule, mesh)
        units = [u for st in self.stages.values() for u in getattr(st, "units", ())]
        self.precision = Precision(list(self.named_parameters()), units)
        factory = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        self.optimizer = factory(self.precision.params)
        self.scheduler = (None if opts.lr_schedule is None
                          else make_scheduler(self.optimizer, opts.lr_schedule))
        self._counted = self._norm_mask()
        self.last_update: UpdateStats | None = None
        """Gradient norm, lr and whether the last `step` was skipped (inf/NaN)."""
        self._evaluator: Any = None
        self.offloader = None if opts.offload is None else ActivationOffloader(
            schedule, c.pp, self.stages, runtime_plan(schedule, opts.offload),
            device=self.device,
        )
        self.executor = self._executor(opts)
        self.holds_loss = schedule.stage_to_rank[-1] == c.pp
        self._data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = (
            iter(data) if data is not None else None
        )
        self.steps_done = 0
        self.seq_shards = dims.tp if opts.sequence_parallel and dims.tp > 1 else 1
        """Sequence shards of a tensor sent between stages (sequence parallelism)."""

    def _norm_mask(self) -> list[bool]:
        """Which local gradients this rank adds to the global norm (stp.train.clip)."""
        tp, tp_rank = self.dims.tp, self.mesh.coord.tp
        keys = [norm_key(st, n, box_of(st, n, p, tp, tp_rank))
                for st in self.stages.values() for n, p in st.named_parameters()]
        gather = None if self.dims.world_size == 1 else functools.partial(
            self._collective, "gradient keys gather", "the world", dist.all_gather_object)
        return counted_mask(keys, rank=self.mesh.rank, gather=gather)

    def _executor(self, opts: TrainerOptions) -> Executor:
        mesh, schedule = self.mesh, self.schedule
        p2p = None
        if self.dims.pp > 1:
            p2p = P2P(mesh.pp_group, mesh.ranks["pp"], schedule.num_stages,
                      timeout=opts.timeout, where=mesh.describe())
        recorder = None
        if opts.trace:
            recorder = Recorder(mesh.rank, [schedule.chunk_of(s)
                                            for s in range(schedule.num_stages)])
        return Executor(
            lower(schedule, lookahead=opts.lookahead), mesh.coord.pp, self.stages, p2p,
            boundary_shape=(1, 1, self.hidden), dtype=opts.dtype, device=self.device,
            where=mesh.describe(),
            collective_peers=mesh.describe_group("tp"),
            offload=self.offloader, braid=opts.braid, recorder=recorder,
        )

    def boundary_shape(self, targets: torch.Tensor) -> tuple[int, ...]:
        """Shape of the hidden states sent between stages for microbatch targets [b, s]:
        [b, s / tp, h] with sequence parallelism (each TP rank sends its rows)."""
        b, s = targets.shape
        return (b, s // self.seq_shards, self.hidden)

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
        self._check_batch(tokens, targets)
        d, m, c = self.dims, self.num_microbatches, self.mesh.coord
        inputs = [t.to(self.device) for t in split_batch(tokens, d.dp, c.dp, m)]
        tgts = [t.to(self.device) for t in split_batch(targets, d.dp, c.dp, m)]
        for st in self.stages.values():
            st.zero_grad()
        self.precision.zero_grad()
        # the mean over the valid (not ignored) targets of the whole global batch
        ratio = valid_token_ratio(targets)
        losses = self.executor.run(inputs, tgts, scale=ratio / m,
                                   boundary_shape=self.boundary_shape(tgts[0]))
        self.precision.fold()
        if self._shared is not None:
            grads = dict(zip(self.precision.names, self.precision.grads(), strict=True))
            self._collective("tied / replicated gradient sum", "the ranks sharing parameters",
                             self._shared, grads)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.holds_loss and c.tp == 0:
            total += sum(float(v) for v in losses.values()) / (m * d.dp) * ratio
        self._collective("loss all-reduce", "the world", dist.all_reduce, total)
        if d.dp > 1:
            self._reduce_dp_grads()
        self.last_update = self._update()
        self.steps_done += 1
        return float(total)

    def _check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """ValueError unless the batch is one the model trains on (the family's rule;
        a stage builder's: token ids and targets of one shape)."""
        if self.family is not None:
            self.family.model.check_batch(tokens, targets)
        else:
            check_text_batch(tokens, targets)

    def _update(self) -> UpdateStats:
        """Global grad norm, clipping, optimizer and LR step (stp.train.precision)."""
        world_sum = None
        if self.dims.world_size > 1:
            world_sum = functools.partial(self._collective, "grad-norm all-reduce", "the world",
                                          dist.all_reduce)
        norm = grad_norm(self.precision.grads(), self._counted, world_sum)
        return apply_update(self.precision, self.optimizer, self.scheduler, norm,
                            self.options.clip_grad)

    def evaluate(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean loss of a global batch, forwards only (stp.train.evaluate). Collective."""
        from stp.train.evaluate import Evaluator

        self._evaluator = self._evaluator or Evaluator(self)
        return self._evaluator.loss(batch)

    # -- checkpoints ------------------------------------------------------------------

    def save(self, directory: str, *, keep: int | None = None) -> str:
        """Write a sharded checkpoint `directory/step-<steps_done>` (stp.train.checkpoint):
        model, fp32 masters, optimizer, LR schedule, step, RNG. Collective."""
        return str(checkpoint.save(self, directory, keep=keep))

    @classmethod
    def resume(cls, path: str, *args: Any, **kwargs: Any) -> Trainer:
        """A Trainer built from the constructor's arguments and loaded from the latest
        complete checkpoint in `path`, whatever mesh or schedule wrote it; `steps_done`
        continues from it, `data` skips the batches already used. Collective."""
        trainer = cls(*args, **kwargs)
        checkpoint.load(trainer, checkpoint.latest(path))
        if trainer._data is not None:
            for _ in range(trainer.steps_done):
                next(trainer._data)
        return trainer

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
        """Average gradients (fp32 main grads in mixed precision) over DP replicas in
        one flat all-reduce."""
        grads = self.precision.grads()
        flat = torch.cat([g.reshape(-1) for g in grads])
        group = self.mesh.dp_group
        what = self.mesh.describe_group("dp")
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
        return gather_full_state(self.stages, self.mesh, self._collective, grads=grads)

    def save_hf(self, directory: str | os.PathLike[str], *,
                max_shard_bytes: int | None = None) -> None:
        """Write the model as a Hugging Face checkpoint directory (config.json, bounded
        safetensors files and their index, the init_from checkpoint's tokenizer files):
        each pipeline rank writes its own stages' files (stp.models.hf.save_stages).
        Collective."""
        if self.family is None:
            raise ValueError("save_hf needs a Trainer built from a ModelConfig or init_from")
        self.family.model.save_hf(directory, self.stages, self.mesh, self.model_config,
                                  source=self.source,
                                  max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)
