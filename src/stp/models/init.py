"""Parameter names, shapes, TP shard dims, the layer split and mesh-independent init.

Every parameter has one global name shared by the reference model and every
stage (`embed.weight`, `layers.3.attn.wq.weight`, `norm.weight`, ...). Its full
value is drawn from a generator seeded by (config.seed, name), then a TP rank
keeps its slice along `shard_dim`: the same seed gives the same full model
whatever pp and tp are, and a rank only creates the layers of its stages.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch

from stp.models.config import ModelConfig

__all__ = [
    "ParamSpec",
    "parameter_specs",
    "stage_layers",
    "init_full",
    "init_shard",
    "shard_range",
]

InitKind = Literal["normal", "normal_out", "ones"]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    """Global name, as in the reference model."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    shard_dim: int | None
    """Tensor dim split over TP ranks; None when replicated (RMSNorm weights)."""
    init: InitKind
    """normal: N(0, init_std); normal_out: N(0, init_std / sqrt(2 L)); ones."""


def layer_specs(config: ModelConfig, layer: int) -> list[ParamSpec]:
    """The nine parameters of one decoder layer. Column-parallel matrices (wq, wk, wv,
    w1, w3: [out, in]) shard dim 0, row-parallel ones (wo, w2) dim 1 (seed 000 Fig. 2,
    Megatron-LM section 3)."""
    h, f = config.hidden, config.ffn
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    p = f"layers.{layer}."
    return [
        ParamSpec(p + "attn_norm.weight", (h,), None, "ones"),
        ParamSpec(p + "attn.wq.weight", (q_out, h), 0, "normal"),
        ParamSpec(p + "attn.wk.weight", (kv_out, h), 0, "normal"),
        ParamSpec(p + "attn.wv.weight", (kv_out, h), 0, "normal"),
        ParamSpec(p + "attn.wo.weight", (h, q_out), 1, "normal_out"),
        ParamSpec(p + "mlp_norm.weight", (h,), None, "ones"),
        ParamSpec(p + "mlp.w1.weight", (f, h), 0, "normal"),
        ParamSpec(p + "mlp.w3.weight", (f, h), 0, "normal"),
        ParamSpec(p + "mlp.w2.weight", (h, f), 1, "normal_out"),
    ]


def parameter_specs(
    config: ModelConfig, layers: range | None = None, *, first: bool = True, last: bool = True
) -> list[ParamSpec]:
    """Specs of the given layers, plus the embedding if `first` and the final norm and
    head if `last`, in model order. Defaults: the whole model."""
    layers = range(config.num_layers) if layers is None else layers
    specs: list[ParamSpec] = []
    if first:
        specs.append(ParamSpec("embed.weight", (config.vocab_size, config.hidden), 0, "normal"))
    for i in layers:
        specs.extend(layer_specs(config, i))
    if last:
        specs.append(ParamSpec("norm.weight", (config.hidden,), None, "ones"))
        specs.append(ParamSpec("head.weight", (config.vocab_size, config.hidden), 0, "normal"))
    return specs


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """Contiguous layer split. When num_layers % num_stages = r > 0, the FIRST r stages
    get one extra layer: the last stage already carries the final norm, the head
    matmul (h x V) and the loss, so it should not also get the longer share."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages={num_stages} must be between 1 and num_layers={num_layers} "
            "(every stage needs at least one layer)"
        )
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} must be in [0, num_stages={num_stages})")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _generator(seed: int, name: str) -> torch.Generator:
    # A stable 63-bit seed from (seed, name): Python's hash() is salted per process.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def init_full(config: ModelConfig, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
    """The full value of one parameter, on CPU. Drawn in float32 and then cast, so a
    float64 model holds exactly the values of a float32 one."""
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    std = config.init_std
    if spec.init == "normal_out":
        std = std / math.sqrt(2 * config.num_layers)
    full = torch.randn(spec.shape, generator=_generator(config.seed, spec.name))
    return (full * std).to(dtype)


def shard_range(size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of rank tp_rank's equal slice of a dim of `size` (size % tp_size == 0)."""
    assert size % tp_size == 0, (size, tp_size)
    part = size // tp_size
    return tp_rank * part, (tp_rank + 1) * part


def init_shard(
    config: ModelConfig,
    spec: ParamSpec,
    tp_size: int,
    tp_rank: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """This TP rank's slice of the full parameter (the whole tensor if replicated)."""
    full = init_full(config, spec, dtype)
    if spec.shard_dim is not None and tp_size > 1:
        start, end = shard_range(spec.shape[spec.shard_dim], tp_size, tp_rank)
        full = full.narrow(spec.shard_dim, start, end - start)
    return full.contiguous().to(device)
