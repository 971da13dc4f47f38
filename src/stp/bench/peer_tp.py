"""The PyTorch side of the peer benchmark at TP x PP, built the torchtitan way.

torchtitan trains a decoder with tensor and pipeline parallelism by putting
DTensor tensor parallelism on each transformer block
(`torch.distributed.tensor.parallel.parallelize_module`, ColwiseParallel on the
q/k/v and gate/up projections, RowwiseParallel on the output and down
projections, a vocabulary-sharded embedding and a column-sharded head), over
a 2-D DeviceMesh (pp outer, tp inner: the rank layout of stp.runtime.mesh), and
driving the stages with a `torch.distributed.pipelining` schedule; optionally
it compiles each block on its own (`torch.compile(block)`). This module does
the same to stp's decoder: the same layers per stage and the same initial
values (stp.models.decoder.init), as nn.Modules a TP plan can name.

Without sequence parallelism the norms are replicated and each block's input
and output are whole activations [b, s, h], as in stp's TP without
`--sequence-parallel`: two all-reduces per layer forward (after wo, after
w2) and two in its backward (on the input gradients of the column-parallel
projections), the collectives STP's braiding hides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from stp.bench.peer_torch import TorchSide, refuse_extras, rms_norm, torch_schedule
from stp.models import ModelConfig
from stp.models.decoder.init import init_full, parameter_specs
from stp.models.decoder.rope import RopeCache, apply_rope
from stp.schedule import Schedule
from stp.schedule.placement import stage_layers

__all__ = ["BlockPart", "tp_plan", "build_tp_stages", "TorchTPSide", "peer_mesh"]


class _Norm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(weight: torch.Tensor) -> nn.Linear:
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=False, device="meta")
    layer.weight = nn.Parameter(weight)
    return layer


class _Attention(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], head_dim: int, rope: RopeCache) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (_linear(w[k]) for k in ("wq", "wk", "wv", "wo"))
        self.head_dim, self.rope = head_dim, rope

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # Column-parallel q/k/v hand back local heads: -1 is this TP rank's head count.
        b, s, _ = h.shape
        q, k, v = (lin(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.wq, self.wk, self.wv))
        cos, sin = self.rope.get(s, h.device, h.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (_linear(w[k]) for k in ("w1", "w2", "w3"))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Block(nn.Module):
    """One decoder layer, the unit torchtitan compiles and parallelizes."""

    def __init__(self, w: dict[str, torch.Tensor], config: ModelConfig, rope: RopeCache) -> None:
        super().__init__()
        self.attn_norm = _Norm(w["attn_norm.weight"], config.norm_eps)
        self.attn = _Attention({k: w[f"attn.{k}.weight"] for k in ("wq", "wk", "wv", "wo")},
                               config.head_dim, rope)
        self.mlp_norm = _Norm(w["mlp_norm.weight"], config.norm_eps)
        self.mlp = _MLP({k: w[f"mlp.{k}.weight"] for k in ("w1", "w2", "w3")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class BlockPart(nn.Module):
    """Layers `layers` of stp's decoder as torchtitan-style modules (embedding, blocks
    under `layers.<i>`, final norm, head), parameters under stp's global names with
    its initial values. first: token ids [b, s] in; last: logits [b, s, V] out."""

    def __init__(self, config: ModelConfig, layers: range, *, first: bool, last: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        refuse_extras(config, "BlockPart")
        w = {s.name: init_full(config, s, dtype)
             for s in parameter_specs(config, layers, first=first, last=last)}
        rope = RopeCache(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed = nn.Embedding.from_pretrained(w["embed.weight"], freeze=False) if first \
            else None
        self.layers = nn.ModuleDict({
            str(i): _Block({k.split(".", 2)[2]: v for k, v in w.items()
                            if k.startswith(f"layers.{i}.")}, config, rope)
            for i in layers})
        self.norm = _Norm(w["norm.weight"], config.norm_eps) if last else None
        self.head = _linear(w["head.weight"]) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)  # [b, s] -> [b, s, h]
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))  # [b, s, V]
        return x


def tp_plan(part: BlockPart, *, shard_embedding: bool = True) -> dict[str, Any]:
    """torchtitan's Llama plan without sequence parallelism, for the modules of `part`;
    shard_embedding=False leaves the embedding replicated (see build_tp_stages)."""
    plan: dict[str, Any] = {}
    if part.embed is not None and shard_embedding:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    for i in part.layers:
        plan |= {f"layers.{i}.attn.{k}": ColwiseParallel() for k in ("wq", "wk", "wv")}
        plan[f"layers.{i}.attn.wo"] = RowwiseParallel()
        plan |= {f"layers.{i}.mlp.{k}": ColwiseParallel() for k in ("w1", "w3")}
        plan[f"layers.{i}.mlp.w2"] = RowwiseParallel()
    if part.head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def peer_mesh(pp: int, tp: int) -> DeviceMesh:
    """The 2-D mesh (pp, tp) over the world, tp fastest as in stp.runtime.mesh."""
    return init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))


def _compile_blocks(part: BlockPart) -> None:
    """torchtitan's per-block compile: each block replaced by torch.compile(block)."""
    for i, block in list(part.layers.items()):
        part.layers[i] = torch.compile(block)  # type: ignore[assignment]  # stub: Callable; a Module


def build_tp_stages(config: ModelConfig, schedule: Schedule, mesh: DeviceMesh,
                    dtype: torch.dtype, *, compile: bool = False) -> list[PipelineStage]:
    """This rank's PipelineStages: stp's layers of each stage it holds (schedule.stages_of
    its pp coordinate), TP-parallelized over the mesh's tp axis when it has more
    than one rank, blocks compiled if asked.

    Compiled, the embedding stays replicated: with torch 2.13 on gloo, the input
    gradient of a compiled block reaches the sharded embedding's output
    redistribution as a plain tensor and its backward fails ("'Tensor' object
    has no attribute '_local_tensor'"); the blocks, where TP's collectives are,
    keep torchtitan's plan."""
    n, tp_mesh = schedule.num_stages, mesh["tp"]
    stages = []
    for s in schedule.stages_of(mesh.get_local_rank("pp")):
        part = BlockPart(config, stage_layers(config.num_layers, s, n), first=s == 0,
                         last=s == n - 1, dtype=dtype)
        if tp_mesh.size() > 1:
            parallelize_module(part, tp_mesh, tp_plan(part, shard_embedding=not compile))
        if compile:
            _compile_blocks(part)
        stages.append(PipelineStage(part, s, n, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    return stages


class TorchTPSide(TorchSide):
    """One rank's torchtitan-style pipeline: TP blocks, PyTorch's schedule on top.
    Construction raises RuntimeError where PyTorch refuses the schedule (ZB-V with
    compiled blocks), on every rank alike."""

    def __init__(self, name: str, schedule: Schedule, mesh: DeviceMesh, config: ModelConfig,
                 dtype: torch.dtype, optimizer: Callable[[list[nn.Parameter]], Any],
                 *, compile: bool = False, from_csv: bool = False) -> None:
        self.stages = build_tp_stages(config, schedule, mesh, dtype, compile=compile)
        self.schedule = torch_schedule(name, schedule, self.stages, from_csv=from_csv)
        mine = schedule.stages_of(mesh.get_local_rank("pp"))
        self.first, self.last = 0 in mine, schedule.num_stages - 1 in mine
        self.m = schedule.num_microbatches
        self.tp_rank = mesh.get_local_rank("tp")
        self.parameters = [p for st in self.stages for p in st.submod.parameters()]
        self.optimizer = optimizer(self.parameters)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Global names (a compiled block's `_orig_mod.` dropped)."""
        return [(k.replace("._orig_mod", ""), p) for st in self.stages
                for k, p in st.submod.named_parameters()]

    def counts_loss(self) -> bool:
        return self.last and self.tp_rank == 0  # every TP rank of the last stage has it

    def local_grads(self) -> tuple[list[torch.Tensor], list[bool]]:
        """Each gradient's local part; a replicated one counted on TP rank 0 only."""
        grads, counted = [], []
        for p in self.parameters:
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sharded = isinstance(p.grad, DTensor) and any(pl.is_shard()
                                                          for pl in p.grad.placements)
            grads.append(local)
            counted.append(sharded or self.tp_rank == 0)
        return grads, counted
