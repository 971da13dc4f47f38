"""What a Trainer is made of: how it runs (`TrainerOptions`) and what it runs with (`Parts`).

`Parts` is everything stp.train.run.setup.build makes once for one rank: the
mesh, the schedule, this rank's stages, their precision, the executor of
this pipeline rank's program, the activation offloader and the gradient
collectives. What running changes (the optimizer's state, the LR schedule,
the step count) the Trainer holds beside it; a checkpoint saves and loads
the Parts with those (stp.train.checkpoint.sharded), the evaluator runs forwards on
them (stp.train.step.evaluate). A module of its own, under setup, so that those
two read the Parts without importing how they are built.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stp.models.hf import HFCheckpoint
from stp.models.recompute import check_recompute
from stp.runtime.executor import Executor
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.offload import ActivationOffloader
from stp.schedule import Schedule
from stp.train.families import TrainFamily
from stp.train.step.gc_pause import StepGC
from stp.train.step.grad_sync import GradSync
from stp.train.step.lr import LRSchedule
from stp.train.step.param_gather import ParamGather
from stp.train.step.precision import Precision

__all__ = ["TrainerOptions", "Parts"]


@dataclass(frozen=True)
class TrainerOptions:
    """How a Trainer runs (what it trains: the model, optimizer and schedule)."""

    dtype: torch.dtype = torch.float32
    """Parameter and activation dtype."""
    device: torch.device | str | None = None
    """None: the mesh's device (CUDA when the backend is NCCL, else the CPU)."""
    timeout: float = 300.0
    """Seconds every receive and collective may wait before the rank gives up."""
    hidden: int | None = None
    """Width of stage boundary tensors; read from a ModelConfig, needed for a builder."""
    lookahead: int = 1
    """Receives are posted this many compute actions early (stp.schedule.lower)."""
    offload: str | None = None
    """Activation offload policy (none, stp, all, selective:X; stp.runtime.offload);
    given, even as "none", resident activation bytes are measured every step."""
    braid: bool = True
    """Run braided blocks unit by unit with the TP all-reduces hidden (False: the
    unbraided baseline)."""
    trace: bool = False
    """Record every step (`write_trace` writes the last one)."""
    clip_grad: float | None = None
    """Clip the global gradient norm to this (stp.train.step.clip); None: measured, not clipped."""
    lr_schedule: LRSchedule | None = None
    """Warm-up and decay of the optimizer's lr (stp.train.step.lr); None: constant."""
    partition: tuple[int, ...] | None = None
    """Transformer layers of each global stage (uneven stages, e.g. fewer on the
    stages holding the embedding and the output layer); None: the even split."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism (stp.models.tp.sequence): between TP regions
    each TP rank holds s/t rows of the sequence; ignored at tp=1 (the identity)."""
    tp_overlap_chunks: int = 0
    """In-layer TP overlap (stp.models.tp.overlap): with `sequence_parallel`, each TP
    region's all-gather and reduce-scatter cut into this many chunks along the
    sequence, each under the next chunk's matmul; 0: off. No effect at tp=1."""
    shard_optimizer: bool = False
    """ZeRO stage 1 (stp.train.step.zero): fp32 masters and optimizer state split over the
    DP ranks, gradients reduce-scattered, parameters all-gathered; nothing at dp=1."""

    recompute: str = "none"
    """Activation recomputation (stp.models.recompute): none, selective (the attention
    core again in B) or full (each unit's forward again in B, from its kept input)."""
    document_eos: int | None = None
    """Document masking (stp.models.documents): the end-of-sequence id that closes each
    document of the packed rows; attention stays within a document, positions restart
    at each document start, and no target crosses a boundary. None: off."""
    compile: bool = False
    """torch.compile the units' pieces between their linears (stp.models.compile): the
    split backward, braiding, offload and recomputation unchanged."""
    overlap_grad_sync: bool = True
    """Launch each stage's DP gradient reduction as soon as its gradients are final
    (its last W), under the rest of the pipeline (stp.train.step.grad_sync); False: all
    of them after the pipeline drains."""
    overlap_param_gather: bool = False
    """With `shard_optimizer` at dp > 1: launch each stage's parameter all-gather
    after the optimizer step and wait for it only before the stage's first forward
    of the next step (stp.train.step.param_gather); False: gathered at once, exposed."""

    gc_every: int = 50
    """Python's garbage collector is off during a step and collects (generations 0
    and 1) before every gc_every-th step (stp.train.step.gc_pause)."""

    def __post_init__(self) -> None:
        check_recompute(self.recompute)
        StepGC(self.gc_every)  # ValueError naming a bad value
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if not isinstance(self.overlap_param_gather, bool):
            raise ValueError("overlap_param_gather must be True or False, got "
                             f"{self.overlap_param_gather!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(f"clip_grad must be > 0 (or None: no clipping), got {self.clip_grad}")
        if isinstance(self.tp_overlap_chunks, bool) or not isinstance(
                self.tp_overlap_chunks, int) or self.tp_overlap_chunks < 0:
            raise ValueError("tp_overlap_chunks must be an integer >= 0 (0: off), got "
                             f"{self.tp_overlap_chunks!r}")
        if self.tp_overlap_chunks and not self.sequence_parallel:
            raise ValueError("--tp-overlap needs --sequence-parallel (it cuts the "
                             "all-gather and reduce-scatter that sequence parallelism runs)")
        if self.tp_overlap_chunks and self.compile:
            raise ValueError("--tp-overlap does not run with --compile yet (its chunks call "
                             "the linears one by one); drop one of them")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")


@dataclass(frozen=True)
class Parts:
    """Everything one rank trains with, built once by stp.train.run.setup.build."""

    mesh: Mesh
    dims: ParallelDims
    schedule: Schedule
    options: TrainerOptions
    device: torch.device
    hidden: int
    """Width of the stage boundary tensors."""
    source: HFCheckpoint | None
    """The Hugging Face checkpoint the weights were read from (init_from)."""
    family: TrainFamily | None
    """The model family of the model's config (stp.train.families); None for a
    stage builder."""
    model_config: Any
    """The family's config (None for a stage builder): checkpoints record its
    shape, save_hf writes it, the shared gradients follow it."""
    stages: dict[int, Any]
    """This rank's PipelineStages by global stage index."""
    holds_loss: bool
    """This pipeline rank runs the last stage, where the loss is."""
    precision: Precision
    offloader: ActivationOffloader | None
    executor: Executor
    sync: GradSync
    param_gather: ParamGather | None = None
    """The parameter all-gathers in flight between steps (`overlap_param_gather`);
    None: gathered at once after each optimizer step."""

    def finish_param_gather(self) -> None:
        """Wait for the parameter all-gathers in flight, if any, and write the model
        parameters: call before reading them between two steps (stp.train.step.param_gather)."""
        if self.param_gather is not None:
            self.param_gather.finish()

    @property
    def seq_shards(self) -> int:
        """Sequence shards of a tensor sent between stages (sequence parallelism)."""
        return self.dims.tp if self.options.sequence_parallel and self.dims.tp > 1 else 1

    def boundary_shape(self, targets: torch.Tensor) -> tuple[int, ...]:
        """Shape of the hidden states sent between stages for microbatch targets [b, s]:
        [b, s / tp, h] with sequence parallelism (each TP rank sends its rows)."""
        b, s = targets.shape
        return (b, s // self.seq_shards, self.hidden)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(global name, local tensor) of every parameter this rank holds."""
        for st in self.stages.values():
            yield from st.named_parameters()
