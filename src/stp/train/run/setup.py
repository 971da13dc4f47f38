"""How a Trainer is set up: the parts it is built from, from what the user passed.

`resolve_schedule`, `stage_builder`
and `world_mesh` turn what the user passed (a schedule name or file, a model
config or builder, a mesh or nothing) into the schedule, the stage builder
and the process groups, each refusing bad input with one ValueError.

`build` makes everything a Trainer runs with, once, as one `Parts`
(stp.train.run.parts; `TrainerOptions`, how it runs, lives there too): this
rank's stages, their precision (stp.train.step.precision), the executor of this
pipeline rank's program, the activation offloader and the gradient
collectives (stp.train.step.grad_sync). The Trainer adds what only running needs
(the optimizer, the LR schedule, the step count); a checkpoint saves and
loads the Parts with those three (stp.train.checkpoint.sharded).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.models.compile import compile_stages
from stp.models.family import refuse_ep
from stp.models.hf import HFCheckpoint, agreeing_config
from stp.runtime.executor import Executor
from stp.runtime.launch import in_torchrun, init_distributed
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.offload import ActivationOffloader, runtime_plan
from stp.runtime.p2p import P2P
from stp.runtime.stage_api import PipelineStage, expert_names, stage_units
from stp.runtime.trace import Recorder
from stp.schedule import Schedule, registry, validate
from stp.schedule.lower import lower
from stp.train.families import family_of
from stp.train.run.parts import Parts, TrainerOptions
from stp.train.run.schedules import is_schedule_file, load_schedule_file
from stp.train.run.startup import load_clock
from stp.train.step.grad_sync import GradSync, collective
from stp.train.step.param_gather import ParamGather
from stp.train.step.precision import Precision
from stp.train.step.zero import DPGroup, ShardedPrecision

__all__ = ["TrainerOptions", "StageBuilder", "Parts", "build", "resolve_schedule",
           "stage_builder", "world_mesh"]

StageBuilder = Callable[..., Any]
"""`builder(stage, num_stages, *, tp_group, tp_size, tp_rank, device, dtype)` -> a
PipelineStage that also has `named_parameters()`, `shard_dim(name)`, `zero_grad()`."""


def resolve_schedule(schedule: str | Schedule, dims: ParallelDims,
                     microbatches: int | None) -> Schedule:
    """A registry name, a schedule file or a Schedule, validated against pp."""
    if isinstance(schedule, str):
        if is_schedule_file(schedule):  # validated, fitted to pp (and microbatches)
            return load_schedule_file(schedule, dims.pp, microbatches)
        return registry.make(schedule, dims.pp, microbatches)
    if schedule.num_ranks != dims.pp:
        raise ValueError(
            f"schedule {schedule.name} has {schedule.num_ranks} ranks, not pp={dims.pp}"
        )
    validate(schedule)
    return schedule

def stage_builder(model: Any, opts: TrainerOptions, num_stages: int, tp: int,
                  source: Any = None, ep: int = 1) -> tuple[StageBuilder, int]:
    """(stage builder, boundary width) for a model family's config (its weights read
    from `source`, an HFCheckpoint, when given) or a builder."""
    family = family_of(model)
    if family is None:
        refuse_ep(ep)  # a stage builder of the user's own has no experts stp could place
    else:
        family.model.check_ep(model, ep)
        family.model.check(model, tp, num_stages)
        weights = None if source is None else load_clock.timed(source.read)
        sp: dict[str, Any] = ({"sequence_parallel": True} if opts.sequence_parallel and tp > 1
                              else {})
        if opts.recompute != "none":
            sp["recompute"] = opts.recompute
        if opts.tp_overlap_chunks and tp > 1:
            if family.name != "decoder":
                raise ValueError(f"--tp-overlap runs on the decoder family only; "
                                 f"--arch {family.name} is refused")
            sp["tp_overlap_chunks"] = opts.tp_overlap_chunks
        builder = family.model.stage_builder(model, num_stages, partition=opts.partition,
                                             weights=weights, **sp)
        return builder, family.model.hidden(model)
    if opts.sequence_parallel:
        raise ValueError("sequence_parallel= needs a model config; a stage builder decides "
                         "its own collectives")
    if opts.partition is not None:
        raise ValueError("partition= splits a ModelConfig's layers; a stage builder "
                         "decides its own stages' layers")
    if opts.recompute != "none":
        raise ValueError(f"recompute={opts.recompute!r} needs a model config; a stage builder "
                         "decides what its own stages keep")
    if isinstance(model, nn.Module) or not callable(model):
        raise ValueError(
            f"Trainer takes a stp.models.ModelConfig, a stage builder function, or None "
            f"with init_from=DIR (a Hugging Face checkpoint), not a {type(model).__name__}"
        )
    if opts.hidden is None:
        raise ValueError("a stage builder needs hidden= (width of boundary tensors)")
    return model, opts.hidden


def world_mesh(dims: ParallelDims, opts: TrainerOptions) -> Mesh:
    """The mesh over the whole world, initialising torch.distributed if needed
    (from torchrun's environment, or a world of one)."""
    device = None if opts.device is None else torch.device(opts.device)
    if not dist.is_initialized():
        if dims.world_size != 1 and not in_torchrun():
            raise ValueError(
                f"a {dims.world_size}-rank mesh needs torch.distributed initialised "
                "(start under torchrun, or use `stp train`)"
            )
        init_distributed(timeout=opts.timeout, device=device)
    return Mesh.from_world(dims, device=device, timeout=opts.timeout)


def build(
    model: Any, schedule: str | Schedule = "stp", *, pp: int = 1, tp: int = 1, dp: int = 1,
    ep: int = 1, microbatches: int | None = None, mesh: Mesh | None = None,
    options: TrainerOptions | None = None,
    init_from: str | os.PathLike[str] | None = None,
) -> Parts:
    """This rank's Parts from the Trainer's arguments (stp.train.step.trainer.Trainer):
    `mesh` given, its dims replace pp, tp, dp, ep. Collective: every rank builds at
    once (the process groups, the ranks' agreement on the gradient norm)."""
    opts = options or TrainerOptions()
    dims = mesh.dims if mesh is not None else ParallelDims(pp, tp, dp, ep)
    schedule = resolve_schedule(schedule, dims, microbatches)
    source = None if init_from is None else HFCheckpoint.open(init_from)
    if source is not None:
        model = agreeing_config(model, source)
    builder, hidden = stage_builder(model, opts, schedule.num_stages, dims.tp, source, dims.ep)
    mesh = mesh or world_mesh(dims, opts)
    device = mesh.device if opts.device is None else torch.device(opts.device)
    family = family_of(model)
    if family is not None:
        builder = family.model.builder_on_mesh(builder, mesh)
    stages = _stages(builder, schedule, mesh, device, opts.dtype)
    if opts.compile:
        compile_stages(stages)
    model_config = None if family is None else model
    shared = None if family is None else family.model.shared_grads(model, stages, schedule, mesh)
    named = [(n, p) for st in stages.values() for n, p in st.named_parameters()]
    units = [u for st in stages.values() for u in stage_units(st)]
    experts = [n for st in stages.values() for n in expert_names(st)]
    precision = _precision(named, units, mesh, opts.shard_optimizer, experts)
    holds_loss = schedule.stage_to_rank[-1] == mesh.coord.pp
    sync = GradSync(mesh, precision, stages, shared=shared, holds_loss=holds_loss,
                    device=device, overlap=opts.overlap_grad_sync)
    offloader = None if opts.offload is None else ActivationOffloader(
        schedule, mesh.coord.pp, stages, runtime_plan(schedule, opts.offload), device=device)
    executor = _executor(schedule, mesh, stages, offloader, opts, hidden, device)
    sync.recorder = executor.recorder
    if sync.overlap:  # each stage's DP reduction under the passes after its last W
        executor.grads_final = sync.stage_final
        if offloader is not None:  # its copies measured with the activations
            offloader.held, sync.sampler = sync.held_bytes, offloader.sample
    param_gather = _param_gather(precision, sync, executor, opts.overlap_param_gather)
    return Parts(mesh=mesh, dims=dims, schedule=schedule, options=opts, device=device,
                 hidden=hidden, source=source, family=family, model_config=model_config,
                 stages=stages,
                 holds_loss=holds_loss, precision=precision, offloader=offloader,
                 executor=executor, sync=sync, param_gather=param_gather)


def _param_gather(precision: Precision, sync: GradSync, executor: Executor,
                  overlap: bool) -> ParamGather | None:
    """With `overlap` and the sharded optimizer: the stages' parameter all-gathers,
    launched after each step in the order this rank's program first runs their
    forwards, each waited for before its stage's first forward (the executor's
    `params_needed`). None otherwise: gathered at once (at dp 1 nothing is sharded)."""
    if not overlap or not isinstance(precision, ShardedPrecision):
        return None
    first = executor.first_forward_action
    order = sorted(sync.stage_params, key=lambda s: first.get(s, len(first)))
    gather = ParamGather(precision, {s: sync.stage_params[s] for s in order},
                         recorder=executor.recorder)
    executor.params_needed = gather.params_needed
    return gather


def _precision(named: list[tuple[str, nn.Parameter]], units: list[Any], mesh: Mesh,
               shard_optimizer: bool, experts: list[str]) -> Precision:
    """The optimizer's parameters: sharded over the DP ranks with `shard_optimizer`
    (stp.train.step.zero; at dp=1 there is nothing to shard; `experts`, with expert
    parallelism, over their expert-data-parallel group), else whole."""
    if not shard_optimizer or mesh.dims.dp == 1:
        return Precision(named, units)
    run = functools.partial(collective, mesh)
    dp = DPGroup(mesh.dims.dp, mesh.coord.dp, mesh.dp_group, run,
                 f"a rank in {mesh.describe_group('dp')}")
    if mesh.dims.ep == 1:
        return ShardedPrecision(named, units, dp)
    edp = DPGroup(mesh.dims.edp, mesh.edp_rank, mesh.edp_group, run,
                  f"a rank in {mesh.describe_group('edp')}", mean_over=mesh.dims.dp)
    return ShardedPrecision(named, units, dp, (edp, frozenset(experts)))


def _stages(builder: StageBuilder, schedule: Schedule, mesh: Mesh, device: torch.device,
            dtype: torch.dtype) -> dict[int, Any]:
    """The stages of `schedule` this rank's pipeline rank holds, checked to be
    PipelineStages (the executor's contract)."""
    c = mesh.coord
    stages = {
        s: builder(s, schedule.num_stages, tp_group=mesh.tp_group, tp_size=mesh.dims.tp,
                   tp_rank=c.tp, device=device, dtype=dtype)
        for s in schedule.stages_of(c.pp)
    }
    for st in stages.values():
        if not isinstance(st, PipelineStage):
            raise ValueError(
                f"the stage builder returned a {type(st).__name__}, not a PipelineStage "
                "(stp.runtime.stage_api)"
            )
    return stages


def _executor(schedule: Schedule, mesh: Mesh, stages: dict[int, Any],
              offloader: ActivationOffloader | None, opts: TrainerOptions, hidden: int,
              device: torch.device) -> Executor:
    """The executor of this pipeline rank's lowered program, with its transfers
    (none on one pipeline rank) and, with `trace`, its recorder."""
    p2p = None
    if mesh.dims.pp > 1:
        p2p = P2P(mesh.pp_group, mesh.ranks["pp"], schedule.num_stages,
                  timeout=opts.timeout, where=mesh.describe())
    recorder = None
    if opts.trace:
        recorder = Recorder(mesh.rank, [schedule.chunk_of(s) for s in range(schedule.num_stages)])
    return Executor(
        lower(schedule, lookahead=opts.lookahead), mesh.coord.pp, stages, p2p,
        boundary_shape=(1, 1, hidden), dtype=opts.dtype, device=device,
        where=mesh.describe(), collective_peers=mesh.describe_group("tp"),
        offload=offloader, braid=opts.braid, recorder=recorder,
    )
