"""One pipeline stage of the decoder: its layers' units, their parameters under the
reference model's global names, and the PipelineStage protocol
(stp.runtime.stage_api) run as "units in order, a synchronous all-reduce between".

A braiding executor (STP paper arXiv 2510.27257, Fig. 3: braided execution blocks) can instead
drive `stage.units` itself, one unit of each of two passes at a time, with the
all-reduces in flight (`launch_allreduce`; stp.runtime.braid).

With `sequence_parallel` (arXiv 2205.05198; stp.models.tp.sequence) `ToScatter`
partials are reduce-scattered into this rank's s/t rows, which stages send.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from stp.models.decoder.chunk import LayerChunk
from stp.models.decoder.doc_masks import DocumentMasks
from stp.models.decoder.end_units import EmbedUnit, LossUnit
from stp.models.decoder.init import ParamSpec, ShardSlice, init_shard, parameter_specs, tp_slice
from stp.models.decoder.stage_setup import (  # re-exported: stp.models names them
    check_model,
    check_tp,
    set_overlap,
    set_recompute,
)
from stp.models.decoder.stage_shards import ShardSource, unshard
from stp.models.decoder.units import AttentionUnit, MLPUnit, RopeCache, Unit
from stp.models.documents import Documents
from stp.models.param_names import register_dotted
from stp.models.placement import StagePlacement
from stp.models.tp.comm import AllReduce, launch_sum, make_allreduce
from stp.models.tp.sequence import SequenceParallel, ToScatter, check_sequence
from stp.shapes.decoder import IGNORE_INDEX, ModelConfig

__all__ = ["ModelStage", "ShardSource", "build_stage", "check_model", "check_tp", "set_recompute"]


class ModelStage(nn.Module):
    """Layers `layer_ids` of the decoder on one TP rank; implements PipelineStage.

    Microbatch bookkeeping: forward(mb) keeps what backward_input(mb) needs; that
    keeps, per linear, (input, output gradient) until backward_weight(mb).

    Buffers: the caller may reuse `x` once forward returns (only fresh tensors
    derived from it are kept), but the `grad` given to backward_input(mb) is
    held by reference (the output gradient of the last row-parallel matrix)
    until backward_weight(mb): do not overwrite it before then. Returned tensors
    are fresh and never written again by the stage, so they can be sent
    asynchronously."""

    def __init__(
        self,
        config: ModelConfig,
        placement: StagePlacement,
        specs: list[ParamSpec],
        tensors: dict[str, torch.Tensor],
        *,
        allreduce: AllReduce,
        async_allreduce: bool = False,
        fuse_layers: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.placement = placement
        self.stage, self.num_stages = placement.stage, placement.num_stages
        self.is_first, self.is_last = placement.is_first, placement.is_last
        self.layer_ids = placement.layers(self._layer_count())
        self.tp_size, self.tp_rank = placement.tp_size, placement.tp_rank
        self.allreduce = allreduce
        self.tp_group = placement.tp_group
        self._async = async_allreduce and self.tp_size > 1
        # One TP rank: nothing to braid, so the layers run as one unit (stp.models.decoder.chunk).
        self.fuse_layers = self.tp_size == 1 if fuse_layers is None else fuse_layers
        self.specs = {s.name: s for s in specs}
        self._shard_dims = {s.name: s.shard_dim for s in specs}
        self._slices = {s.name: tp_slice(config, s, self.tp_size, self.tp_rank) for s in specs}
        for spec in specs:
            register_dotted(self, spec.name, nn.Parameter(tensors[spec.name]))
        # A tuple, not a ModuleList: units reference the parameters registered above.
        self.units: tuple[Unit, ...] = tuple(self._make_units(dict(self.named_parameters())))
        # One TP rank: the sequence has one shard, so sequence parallelism is the identity.
        self.sequence_parallel = self.prepares_gathers = placement.shards_sequence
        # (prepares_gathers: units launch their all-gather in prepare_*; stp.runtime.braid)
        self.seq = (SequenceParallel(self.tp_group, self.tp_size, self.tp_rank)
                    if self.prepares_gathers else None)
        for unit in self.units:
            unit.seq = self.seq
        self.recompute = set_recompute(self.units, placement.recompute)

    def _layer_count(self) -> int:
        """The layers `placement.partition` splits (a family with more than the
        decoder's: its own count)."""
        return self.config.num_layers

    def _make_units(self, p: dict[str, nn.Parameter]) -> list[Unit]:
        config, tp_size, tp_rank = self.config, self.tp_size, self.tp_rank
        vocab_part = config.padded_vocab(tp_size) // tp_size
        vocab_start = tp_rank * vocab_part
        one_graph = tp_size == 1  # no all-reduce between a unit's norm and its body
        units: list[Unit] = []
        layers: list[AttentionUnit | MLPUnit] = []
        if self.is_first:
            units.append(EmbedUnit(p["embed.weight"], vocab_start, config.pad_token_id,
                                   whole_vocab=tp_size == 1))
        rope = RopeCache(config.head_dim, config.rope_theta, config.rope_scaling)
        for i in self.layer_ids:
            a, m = f"layers.{i}.attn", f"layers.{i}.mlp"
            biases = (p[f"{a}.wq.bias"], p[f"{a}.wk.bias"], p[f"{a}.wv.bias"]) if (
                config.qkv_bias) else None
            layers.append(AttentionUnit(
                i, p[f"layers.{i}.attn_norm.weight"], p[f"{a}.wq.weight"], p[f"{a}.wk.weight"],
                p[f"{a}.wv.weight"], p[f"{a}.wo.weight"],
                head_dim=config.head_dim, eps=config.norm_eps, rope=rope, biases=biases,
                one_graph=one_graph,
            ))
            layers.append(MLPUnit(
                i, p[f"layers.{i}.mlp_norm.weight"], p[f"{m}.w1.weight"], p[f"{m}.w3.weight"],
                p[f"{m}.w2.weight"], eps=config.norm_eps, one_graph=one_graph,
            ))
        if self.fuse_layers and one_graph:
            units.append(LayerChunk(layers))
        else:
            units.extend(layers)
        if self.is_last:
            head = self._slices["head.weight"]
            valid = vocab_part if head.dim is None else head.stop - head.start
            units.append(LossUnit(
                p["norm.weight"], p["head.weight"], eps=config.norm_eps,
                vocab_start=vocab_start, tp_size=tp_size, tp_rank=tp_rank, vocab_valid=valid,
                one_graph=one_graph,
            ))
        return units

    def shard_dim(self, name: str) -> int | None:
        """The tensor dim of parameter `name` split over TP ranks; None if replicated."""
        if name not in self._shard_dims:
            raise ValueError(
                f"stage {self.stage} has no parameter {name!r}; it holds {sorted(self._shard_dims)}"
            )
        return self._shard_dims[name]

    def shard_slice(self, name: str) -> ShardSlice:
        """Which rows of the full parameter `name` this rank holds (and its padding)."""
        self.shard_dim(name)  # ValueError for an unknown name
        return self._slices[name]

    def unshard(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every TP rank's shard (in TP rank order): padding
        dropped, replicated kv heads taken once."""
        return unshard(self.config, self.specs[name], parts)

    # -- PipelineStage ---------------------------------------------------------

    def launch_allreduce(
        self, partial: torch.Tensor | ToScatter
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """Start the TP all-reduce of a unit's partial sum and return at once (braided
        execution, STP paper arXiv 2510.27257, Fig. 3): (the tensor, reduced in place when `work`
        completes; work). Work is None when the result is already there: one TP rank,
        or the synchronous `allreduce` build_stage was given. A `ToScatter` partial (SP)
        is reduce-scattered instead: the tensor is this rank's rows."""
        if isinstance(partial, ToScatter):
            return partial.launch(self._sp())
        if not self._async:
            return self.allreduce(partial), None
        tensor = partial.contiguous()
        return tensor, launch_sum(tensor, self.tp_group)

    def _sp(self) -> SequenceParallel:
        """The SP group a `ToScatter` partial reduce-scatters over (units make one
        only under sequence parallelism)."""
        if self.seq is None:
            raise RuntimeError("a reduce-scatter partial without sequence parallelism")
        return self.seq

    def take_gathers(self) -> list[tuple[float, float, float]]:
        """The SP all-gathers since the last call (SequenceParallel.take_gathers)."""
        return [] if self.seq is None else self.seq.take_gathers()

    def _reduce(self, partial: torch.Tensor | ToScatter | None) -> torch.Tensor | None:
        """The synchronous hand-off between units: all-reduce, or reduce-scatter."""
        if isinstance(partial, ToScatter):
            out, work = partial.launch(self._sp())
            if work is not None:
                work.wait()
            return out
        return None if partial is None else self.allreduce(partial)

    def load_documents(self, docs: Sequence[Documents]) -> None:
        """Document masking for this step: the layout of each microbatch's rows (in
        microbatch order), which every attention unit of the stage then uses: RoPE
        at the positions within each document, attention within each document
        (stp.models.documents). Every stage derives them from the same token ids."""
        attention = [p for u in self.units for p in (u.parts if isinstance(u, LayerChunk)
                                                      else (u,))
                     if isinstance(p, AttentionUnit)]
        if not attention:
            return
        masks = attention[0].documents or DocumentMasks(attention[0].rope)
        weight = attention[0].wq
        masks.load(docs, weight.device, weight.dtype)
        for unit in attention:
            unit.documents = masks

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        """ValueError unless x (and targets, last stage only) fit this stage."""
        c = self.config
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"stage 0 takes token ids [batch, seq] of int32/int64, got "
                    f"{x.dtype} {tuple(x.shape)}"
                )
            # Value checks only on CPU, read on the host (numpy: no aten op, no sync);
            # on an accelerator they would sync every microbatch.
            ids = x.numpy() if x.device.type == "cpu" else None
            if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= c.vocab_size):
                raise ValueError(f"token ids must be in [0, vocab_size={c.vocab_size})")
        elif x.dim() != 3 or x.shape[-1] != c.hidden:
            raise ValueError(
                f"stage {self.stage} takes hidden states [batch, seq, {c.hidden}], "
                f"got {tuple(x.shape)}"
            )
        # with sequence parallelism a later stage receives its s/t rows
        seq = x.shape[1] * (self.tp_size if self.sequence_parallel and not self.is_first else 1)
        if seq > c.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={c.max_seq_len}")
        if self.sequence_parallel and self.is_first:
            check_sequence(seq, self.tp_size)
        if self.is_last:
            if targets is None or tuple(targets.shape) != (x.shape[0], seq):
                got = None if targets is None else tuple(targets.shape)
                raise ValueError(
                    f"the last stage needs targets of shape {(x.shape[0], seq)}, got {got}"
                )
            t = targets.numpy() if targets.device.type == "cpu" else None
            if t is not None and ((t < 0) & (t != IGNORE_INDEX) | (t >= c.vocab_size)).any():
                raise ValueError(f"targets must be in [0, vocab_size={c.vocab_size}) or "
                                 f"{IGNORE_INDEX} (left out of the loss)")
        elif targets is not None:
            raise ValueError(f"stage {self.stage} is not the last stage; it takes no targets")

    def forward(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F: run the units in order with a synchronous all-reduce between."""
        self.check_input(x, targets)
        for unit in self.units:
            partial = unit.forward_partial(mb, x, targets if unit is self.units[-1] else None)
            x = unit.forward_finish(mb, self._reduce(partial))
        return x.detach()

    def backward_input(
        self, mb: int, grad: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor | None:
        """B: input gradients only, units in reverse; weight work waits for W."""
        if self.is_last:
            if grad is not None:
                raise ValueError(
                    "the last stage takes no output gradient (its loss gradient is `scale`)"
                )
            g: torch.Tensor | None = torch.tensor(scale, dtype=torch.float64)
        else:
            if grad is None:
                raise ValueError(f"stage {self.stage} needs the output gradient of microbatch {mb}")
            g = grad
        for unit in reversed(self.units):
            assert g is not None
            partial = unit.backward_partial(mb, g)
            g = unit.backward_finish(mb, self._reduce(partial))
        return g

    def weights_in_backward(self, mbs: Iterable[int]) -> None:
        """Microbatches whose backward is a full BW (the executor reads it off the
        schedule): at one TP rank their forward runs in plain autograd and B computes
        the weight gradients in the same graph walk, which W then only adds (Zero
        Bubble's deferral, arXiv 2401.10241, pays only when W runs later)."""
        at_once = frozenset(mbs)
        for unit in self.units:
            unit.weights_at_once = at_once

    def backward_weight(self, mb: int) -> None:
        """W: every unit's deferred weight gradients of mb into `.grad`."""
        for unit in reversed(self.units):
            unit.weight(mb)

    def backward_full(
        self, mb: int, grad: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor | None:
        """BW: B then W."""
        grad_in = self.backward_input(mb, grad, scale)
        self.backward_weight(mb)
        return grad_in

    # -- bookkeeping -----------------------------------------------------------

    def pending_backward(self) -> list[int]:
        """Microbatches forwarded whose B has not finished."""
        return sorted({mb for u in self.units for mb in u.pending_backward()})

    def pending_weight(self) -> list[int]:
        """Microbatches whose B finished and whose W has not run."""
        return sorted({mb for u in self.units for mb in u.pending_weight()})

    def kept_tensors(self, mb: int) -> list[torch.Tensor]:
        """Tensors the units hold for microbatch mb (stp.runtime.offload)."""
        return [t for unit in self.units for t in unit.kept_tensors(mb)]

    def shared_tensors(self) -> list[torch.Tensor]:
        """Tensors every microbatch uses besides parameters: the rotary tables."""
        parts = [p for u in self.units for p in (u.parts if isinstance(u, LayerChunk) else (u,))]
        ropes = {id(u.rope): u.rope for u in parts if isinstance(u, AttentionUnit)}
        return [t for rope in ropes.values() for t in rope.tensors()]

    def reset(self) -> None:
        """Drop all microbatch state (e.g. after a failed step); gradients are kept."""
        for unit in self.units:
            unit.reset()


def build_stage(
    config: ModelConfig,
    placement: StagePlacement,
    *,
    allreduce: AllReduce | None = None,
    weights: ShardSource = init_shard,
    fuse_layers: bool | None = None,
) -> ModelStage:
    """Materialise only the stage `placement` names (stp.models.placement: its stage,
    TP rank, device, dtype, partition, sequence parallelism, recomputation).

    Layers are split contiguously: `placement.partition` gives the layers of each
    global stage (uneven stages), else the even split (stp.schedule.placement.
    partition_layers: the first num_layers % num_stages stages get one extra).
    Stage 0 also holds the vocab-parallel embedding; the last stage the final
    RMSNorm, the vocab-sharded head and the vocab-parallel cross-entropy.
    `allreduce` (default: a sum all-reduce on the placement's tp_group, identity when
    tp_size == 1) runs between units. With tp_size > 1 and no tp_group, the
    default group is used if its size is tp_size.
    `weights(config, spec, tp_size, tp_rank, device=, dtype=)` gives each parameter's
    shard: the seeded init by default, or a checkpoint's slice (stp.models.hf).
    `fuse_layers` (default: when tp_size == 1) runs the stage's layers as one unit
    (stp.models.decoder.chunk): with one TP rank there is no all-reduce for units to hide.
    Sequence parallelism (stp.models.tp.sequence; the identity at tp_size 1) needs
    the TP process group, not a custom `allreduce`."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(placement, StagePlacement):
        raise ValueError(f"placement must be a StagePlacement, got {type(placement).__name__}")
    p = placement
    if p.num_stages > config.num_layers:
        raise ValueError(
            f"num_layers={config.num_layers} must be >= num_stages={p.num_stages} "
            "(every stage needs at least one layer)"
        )
    check_tp(config, p.tp_size, p.tp_rank)
    custom = allreduce is not None
    if p.sequence_parallel and custom and p.tp_size > 1:
        raise ValueError("sequence_parallel reduce-scatters on the TP group; it takes no "
                         "custom allreduce")
    if allreduce is None:
        _check_tp_group(p)
        allreduce = make_allreduce(p.tp_group, p.tp_size)
    layers = p.layers(config.num_layers)
    specs = parameter_specs(config, layers, first=p.is_first, last=p.is_last)
    tensors = {
        s.name: weights(config, s, p.tp_size, p.tp_rank, device=p.device, dtype=p.dtype)
        for s in specs
    }
    stage = ModelStage(config, p, specs, tensors, allreduce=allreduce,
                       async_allreduce=not custom, fuse_layers=fuse_layers)
    if p.tp_overlap_chunks:  # in-layer TP overlap (stp.models.decoder.chunked)
        set_overlap(stage.units, p.tp_overlap_chunks, p.recompute)
    return stage


def _check_tp_group(p: StagePlacement) -> None:
    """ValueError unless the TP group (or the default one) has tp_size ranks, this one
    at tp_rank: the all-reduce between units runs on it."""
    if p.tp_size == 1:
        return
    p.check_distributed()
    size, rank = dist.get_world_size(p.tp_group), dist.get_rank(p.tp_group)
    if (size, rank) != (p.tp_size, p.tp_rank):
        raise ValueError(
            f"tp_size={p.tp_size}, tp_rank={p.tp_rank} disagree with the TP group "
            f"(size {size}, this rank {rank})"
        )
