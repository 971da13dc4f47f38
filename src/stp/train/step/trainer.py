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
       as each stage's last W ends, its DP reduction is launched under the
       rest of the pipeline (`overlap_grad_sync`, stp.train.step.grad_sync);
    3. the step's collectives (stp.train.step.grad_sync): shared gradients summed,
       the loss (mean over microbatches and replicas) summed over the world
       from the ranks holding it, so every rank returns the same number,
       gradients averaged over DP replicas (the reductions in flight waited
       for, the rest run now; one flat all-reduce per stage; with
       `shard_optimizer` a reduce-scatter, each replica keeping its rows:
       stp.train.step.zero), and the global gradient norm taken over the whole model;
       the loss and the norm are read from the device together, the step's one
       host sync (tests/train/test_host_syncs.py);
    4. the gradients are clipped by that norm (stp.train.step.clip; inf/NaN: the
       step is skipped on every rank); the optimizer steps, in bf16 on fp32
       master weights and main grads (stp.train.step.precision), and the LR
       schedule advances (stp.train.step.lr). With `shard_optimizer` the updated shards
       are all-gathered into the model; with `overlap_param_gather` each stage's
       all-gather is only launched here and waited for before that stage's first
       forward of the next step (stp.train.step.param_gather): whatever reads the
       model between two steps (save, evaluate, the gathers and exports, the
       parameters) calls `finish_param_gather` first.

What a Trainer runs with is built once by stp.train.run.setup.build (its `parts`);
the Trainer itself adds the optimizer, the LR schedule and the step count.

`save(dir)` and `Trainer.resume(dir, ...)` write and read sharded checkpoints
that any mesh can load (stp.train.checkpoint.sharded).

Nothing is scaled twice: 1/m once in the backward seed, 1/dp once in the
DP average.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, is_dataclass
from math import prod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stp.models.family import check_text_batch
from stp.models.hf import DEFAULT_SHARD_BYTES, save_stages
from stp.models.tp.layers import valid_token_ratio
from stp.runtime.mesh import Mesh
from stp.runtime.offload import StepMemory
from stp.runtime.trace import gather_spans, write_trace
from stp.schedule import Schedule
from stp.train.checkpoint import sharded as checkpoint
from stp.train.checkpoint.gather import gather_full_state
from stp.train.checkpoint.save_full import full_layout, write_full
from stp.train.data.corpus import split_batch
from stp.train.run.parts import Parts, TrainerOptions
from stp.train.run.setup import StageBuilder, build
from stp.train.run.startup import load_clock
from stp.train.step.aux_losses import AuxLosses
from stp.train.step.documents import mask_documents
from stp.train.step.gc_pause import StepGC, gc_paused
from stp.train.step.lr import LRSchedule, make_scheduler
from stp.train.step.peaks import world_peaks
from stp.train.step.precision import UpdateStats, apply_update

if TYPE_CHECKING:  # built on the first evaluate (its import kept off the step's path)
    from stp.train.step.evaluate import Evaluator

__all__ = ["Trainer", "TrainerOptions", "StageBuilder", "OptimizerFactory"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Trainer:
    """Trains one model on a pp x tp x dp mesh with one schedule (see module doc).

    `model`: a `stp.models.ModelConfig`, a multimodal `stp.shapes.mllm.
    MLLMConfig` (batches: pixel bytes + tokens, targets over image + text
    positions; stp.train.data.images) or a StageBuilder. `optimizer`: a
    factory taking this rank's parameters. `schedule`: a registry name, a
    schedule file (FILE.json / FILE.csv, as `stp search --out` writes) or a
    Schedule for pp ranks. `mesh`: reuse existing process groups (else they
    are created from the world; a world of one needs no launcher). `data`:
    an iterable of (tokens, targets) global batches for `step()` without an
    argument. `options` (TrainerOptions), or its fields as keywords (not both).

    What is built once (the mesh, schedule, stages, precision, executor,
    offloader, gradient collectives, and the options they were built with) is
    `parts` (stp.train.run.parts.Parts), read there: `trainer.parts.stages`; the
    Trainer holds what running changes: the optimizer, the LR schedule, the step
    count.
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
        ep: int = 1,
        microbatches: int | None = None,
        mesh: Mesh | None = None,
        data: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
        options: TrainerOptions | None = None,
        init_from: str | os.PathLike[str] | None = None,
        # TrainerOptions' fields, for a call that gives them one by one (not with options=)
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        hidden: int | None = None,
        lookahead: int = 1,
        offload: str | None = None,
        braid: bool = True,
        trace: bool = False,
        clip_grad: float | None = None,
        lr_schedule: LRSchedule | None = None,
        partition: tuple[int, ...] | None = None,
        sequence_parallel: bool = False,
        tp_overlap_chunks: int = 0,
        shard_optimizer: bool = False,
        recompute: str = "none",
        document_eos: int | None = None,
        compile: bool = False,
        overlap_grad_sync: bool = True,
        overlap_param_gather: bool = False,
        gc_every: int = 50,
    ) -> None:
        given = TrainerOptions(
            dtype=dtype, device=device, timeout=timeout, hidden=hidden, lookahead=lookahead,
            offload=offload, braid=braid, trace=trace, clip_grad=clip_grad,
            lr_schedule=lr_schedule, partition=partition, sequence_parallel=sequence_parallel,
            tp_overlap_chunks=tp_overlap_chunks, shard_optimizer=shard_optimizer,
            recompute=recompute, document_eos=document_eos,
            compile=compile, overlap_grad_sync=overlap_grad_sync,
            overlap_param_gather=overlap_param_gather, gc_every=gc_every)
        if options is not None and given != TrainerOptions():
            raise ValueError("Trainer takes options=TrainerOptions(...) or its fields as "
                             "keywords, not both")
        opts = given if options is None else options
        self.parts: Parts = build(model, schedule, pp=pp, tp=tp, dp=dp, ep=ep,
                                  microbatches=microbatches, mesh=mesh, options=opts,
                                  init_from=init_from)
        factory = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        self.optimizer = factory(self.parts.precision.params)
        self.scheduler = (None if opts.lr_schedule is None
                          else make_scheduler(self.optimizer, opts.lr_schedule))
        self.last_update: UpdateStats | None = None
        """Gradient norm, lr and whether the last `step` was skipped (inf/NaN)."""
        self.aux = AuxLosses.of(self.parts.stages, self.parts.sync, self.parts.mesh,
                                self.parts.device)
        """Objective terms beside the loss (an MoE's load balancing); None: none."""
        self.last_figures: dict[str, float] = {}
        """The last step's figures of those terms (`aux_loss`, `expert_load`)."""
        self._evaluator: Evaluator | None = None
        self._data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = (
            iter(data) if data is not None else None
        )
        self.steps_done = 0
        self.step_gc = StepGC(opts.gc_every)

    # -- what was built is `parts` (stp.train.run.parts.Parts): read it there ----------

    def finish_param_gather(self) -> None:
        """Wait for the parameter all-gathers the last step left in flight
        (`overlap_param_gather`) and write the model parameters; nothing otherwise.
        Every reader of the model between two steps calls it first. Not collective:
        every rank launched them in the same step."""
        self.parts.finish_param_gather()

    @property
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, stage by stage."""
        self.finish_param_gather()
        return [p for st in self.parts.stages.values() for p in st.parameters()]

    @property
    def memory(self) -> StepMemory | None:
        """This rank's activation bytes in the last step (None without `offload`)."""
        offloader = self.parts.offloader
        return None if offloader is None else offloader.memory

    def activation_peaks(self) -> list[int] | None:
        """Peak resident activation bytes of the last step on every global rank
        (collective: every rank calls it); None without `offload`."""
        offloader = self.parts.offloader
        if offloader is None:
            return None
        peaks, self.copy_peaks = world_peaks(self.parts, offloader.memory)
        """`copy_peaks`: what the DP reductions' copies in flight added to each rank's
        peak (`StepMemory.peak_with_held`), set with the peaks."""
        return peaks

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(global name, local tensor) of every parameter this rank holds."""
        self.finish_param_gather()
        return self.parts.named_parameters()

    # -- one iteration ------------------------------------------------------------

    @gc_paused
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
        parts = self.parts
        d, m, c = parts.dims, parts.schedule.num_microbatches, parts.mesh.coord
        targets = mask_documents(parts, tokens, targets, m)  # with document masking
        inputs = [t.to(parts.device) for t in split_batch(tokens, d.dp, c.dp, m)]
        tgts = [t.to(parts.device) for t in split_batch(targets, d.dp, c.dp, m)]
        for st in parts.stages.values():
            st.zero_grad()
        parts.precision.zero_grad()
        self.parts.sync.start_step()
        # the mean over the valid (not ignored) targets of the whole global batch
        ratio = valid_token_ratio(targets)
        if self.aux is not None:
            self.aux.start(m)
        losses = parts.executor.run(inputs, tgts, scale=ratio / m,
                                    boundary_shape=parts.boundary_shape(tgts[0]))
        figures = None if self.aux is None else self.aux.reduce()
        parts.precision.fold()
        # the loss, the norm (whose finiteness decides the skip) and the aux figures
        # are read from the device at once: the step's one host sync
        loss, norm = self.parts.sync.after_backward(losses, m, ratio, figures)
        if self.aux is not None:
            self.last_figures = self.aux.figures(self.parts.sync.extra_values, m)
        gather = self.parts.param_gather
        self.last_update = apply_update(parts.precision, self.optimizer, self.scheduler, norm,
                                        parts.options.clip_grad,
                                        None if gather is None else gather.launch)
        self.steps_done += 1
        return loss

    def _check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """ValueError unless the batch is one the model trains on (the family's rule;
        a stage builder's: token ids and targets of one shape)."""
        family = self.parts.family
        if family is not None:
            family.model.check_batch(tokens, targets)
        else:
            check_text_batch(tokens, targets)

    def evaluate(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean loss of a global batch, forwards only (stp.train.step.evaluate). Collective."""
        from stp.train.step.evaluate import Evaluator

        self._evaluator = self._evaluator or Evaluator(self.parts)
        self.finish_param_gather()
        return self._evaluator.loss(batch)

    # -- checkpoints ------------------------------------------------------------------

    def save(self, directory: str, *, keep: int | None = None) -> str:
        """Write a sharded checkpoint `directory/step-<steps_done>` (stp.train.checkpoint.sharded):
        model, fp32 masters, optimizer, LR schedule, step, RNG. Collective."""
        self.finish_param_gather()
        return str(checkpoint.save(self.parts, self.optimizer, self.scheduler, self.steps_done,
                                   directory, keep=keep))

    @classmethod
    def resume(cls, path: str, *args: Any, allow_unverified: bool = False,
               **kwargs: Any) -> Trainer:
        """A Trainer built from the constructor's arguments and loaded from the latest
        complete checkpoint in `path`, whatever mesh or schedule wrote it; `steps_done`
        continues from it, `data` skips the batches already used. A checkpoint without
        its checksum manifest is refused unless `allow_unverified`. Collective."""
        trainer = cls(*args, **kwargs)
        load = load_clock.timed(checkpoint.load)  # start-up's `load` (stp.train.run.startup)
        trainer.steps_done = load(trainer.parts, trainer.optimizer, trainer.scheduler,
                                  checkpoint.latest(path), allow_unverified=allow_unverified)
        if trainer._data is not None:
            for _ in range(trainer.steps_done):
                next(trainer._data)
        return trainer

    def write_trace(self, path: str, meta: dict[str, object] | None = None) -> None:
        """Write the last step's measured trace of every rank to `path` on global
        rank 0 (stp.runtime.trace; needs `trace=True`). Collective."""
        rec = self.parts.executor.recorder
        if rec is None:
            raise ValueError("write_trace needs Trainer(..., trace=True)")
        spans = gather_spans(rec)
        if spans is not None:
            dims = self.parts.dims
            pp_of = {r: dims.coord_of(r).pp for r in range(dims.world_size)}
            write_trace(path, spans, self.parts.schedule, pp_of, meta)

    # -- gathering ------------------------------------------------------------------

    def full_state_dict(self, *, grads: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters (or with grads=True their gradients) on
        global rank 0, on the CPU, under the reference's names: TP shards
        concatenated along shard_dim, stages gathered over PP. None elsewhere.
        With `shard_optimizer` at dp > 1 the DP mean of a gradient exists only
        as shards (`precision.grads()`): grads=True gives DP rank 0's own.
        Collective: every rank must call it."""
        self.finish_param_gather()
        return gather_full_state(self.parts.stages, self.parts.mesh, self.parts.sync.collective,
                                 grads=grads)

    def save_full(self, path: str | os.PathLike[str]) -> None:
        """Write the whole model as one safetensors file `path`, under the reference's
        names (what full_state_dict returns), stage by stage: no rank holds more than
        its shards and one full tensor (stp.train.checkpoint.save_full). Collective."""
        config = self.parts.model_config
        meta = {} if not is_dataclass(config) or isinstance(config, type) else {
            "stp_model_config": json.dumps(asdict(config), sort_keys=True, default=str)}
        self.finish_param_gather()
        write_full(path, self.parts.stages, self.parts.mesh, self.parts.sync.collective, meta)

    def parameter_count(self) -> int:
        """Elements of the whole model (each full tensor once, as full_state_dict would
        hold them), counted without gathering a tensor. Collective."""
        parts = self.parts
        return sum(prod(e.shape) for e in full_layout(parts.stages, parts.mesh,
                                                      parts.sync.collective))

    def save_hf(self, directory: str | os.PathLike[str], *,
                max_shard_bytes: int | None = None) -> None:
        """Write the model as a Hugging Face checkpoint directory (config.json, bounded
        safetensors files and their index, the init_from checkpoint's tokenizer files):
        each pipeline rank writes its own stages' files (stp.models.hf.save_stages).
        Collective."""
        parts = self.parts
        if parts.family is None:
            raise ValueError("save_hf needs a Trainer built from a ModelConfig or init_from")
        self.finish_param_gather()
        if parts.family.model.hf_refusal is not None:
            raise ValueError(parts.family.model.hf_refusal)
        save_stages(os.fspath(directory), parts.stages, parts.mesh, parts.model_config,
                    source=parts.source, max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)
