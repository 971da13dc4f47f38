"""Parameter names, shapes, TP shard dims, the layer split and mesh-independent init.

Every parameter has one global name shared by the reference model and every
stage (`embed.weight`, `layers.3.attn.wq.weight`, `norm.weight`, ...). Its value
is a function of (config.seed, name, element index) (stp.models.counter_rng), and
a TP rank computes only its slice along `shard_dim` (`tp_slice`), on its own
device: the same seed gives the same full model whatever pp and tp are, a rank
only creates the layers of its stages, and no rank draws a whole tensor to keep a
part of it. A checkpoint loader (stp.models.hf) reads the same slices from disk.

Two splits are not equal cuts of the full tensor:
- the vocabulary (embedding, head) is padded to a multiple of tp: a rank's
  slice may end in zero rows past vocab_size;
- with fewer kv heads than TP ranks, each rank holds the whole kv head its
  query heads use, so tp / num_kv_heads ranks hold a copy of each (Megatron-LM
  style replication of query groups instead of refusing the mesh).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import torch

from stp.models.counter_rng import normal_slice, splitmix_key
from stp.shapes.decoder import ModelConfig

__all__ = [
    "ParamSpec",
    "ShardSlice",
    "tp_slice",
    "pad_shard",
    "parameter_specs",
    "init_full",
    "init_shard",
    "init_slice",
    "shard_range",
]

InitKind = Literal["normal", "normal_out", "ones", "zeros"]
TPSplit = Literal["even", "vocab", "kv_heads"]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    """Global name, as in the reference model."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    shard_dim: int | None
    """Tensor dim split over TP ranks; None when replicated (RMSNorm weights)."""
    init: InitKind
    """normal: N(0, init_std); normal_out: N(0, init_std / sqrt(2 L)); ones; zeros."""
    tp_split: TPSplit = "even"
    """How shard_dim is cut: equal parts, the padded vocabulary, or whole kv heads."""
    tied_to: str | None = None
    """The parameter this one is a copy of (a tied head: embed.weight): initialised,
    loaded and saved as that one, its gradient summed with it every step."""


def count_parameters(specs: list[ParamSpec]) -> int:
    """Elements of `specs`, each stored tensor once (a tied copy is its original's)."""
    return sum(math.prod(s.shape) for s in specs if s.tied_to is None)


def layer_specs(config: ModelConfig, layer: int) -> list[ParamSpec]:
    """The nine parameters of one decoder layer (twelve with q/k/v biases).
    Column-parallel matrices (wq, wk, wv, w1, w3: [out, in]) and the biases shard
    dim 0, row-parallel ones (wo, w2) dim 1 (STP paper, arXiv 2510.27257, Fig. 2;
    Megatron-LM, arXiv 1909.08053, section 3)."""
    h, f = config.hidden, config.ffn
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    p = f"layers.{layer}."
    biases = [
        ParamSpec(p + "attn.wq.bias", (q_out,), 0, "zeros"),
        ParamSpec(p + "attn.wk.bias", (kv_out,), 0, "zeros", "kv_heads"),
        ParamSpec(p + "attn.wv.bias", (kv_out,), 0, "zeros", "kv_heads"),
    ] if config.qkv_bias else []
    return [
        ParamSpec(p + "attn_norm.weight", (h,), None, "ones"),
        ParamSpec(p + "attn.wq.weight", (q_out, h), 0, "normal"),
        ParamSpec(p + "attn.wk.weight", (kv_out, h), 0, "normal", "kv_heads"),
        ParamSpec(p + "attn.wv.weight", (kv_out, h), 0, "normal", "kv_heads"),
        *biases,
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
    vocab = (config.vocab_size, config.hidden)
    if first:
        specs.append(ParamSpec("embed.weight", vocab, 0, "normal", "vocab"))
    for i in layers:
        specs.extend(layer_specs(config, i))
    if last:
        specs.append(ParamSpec("norm.weight", (config.hidden,), None, "ones"))
        tied = "embed.weight" if config.tie_embeddings else None
        specs.append(ParamSpec("head.weight", vocab, 0, "normal", "vocab", tied))
    return specs


def _key(seed: int, name: str) -> int:
    # A stable 64-bit key from (seed, name): Python's hash() is salted per process.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return splitmix_key(int.from_bytes(digest[:8], "little"))


def init_full(config: ModelConfig, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
    """The full value of one parameter, on CPU (init_slice of the whole tensor)."""
    return init_slice(config, spec, ShardSlice(None), device="cpu", dtype=dtype)


def shard_range(size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of rank tp_rank's equal slice of a dim of `size` (size % tp_size == 0)."""
    assert size % tp_size == 0, (size, tp_size)
    part = size // tp_size
    return tp_rank * part, (tp_rank + 1) * part


@dataclass(frozen=True)
class ShardSlice:
    """What one TP rank holds of a parameter: rows [start, stop) of the full tensor
    along `dim` (None: the whole tensor), then `pad` rows of zeros (vocabulary
    padding)."""

    dim: int | None
    start: int = 0
    stop: int = 0
    pad: int = 0


def tp_slice(config: ModelConfig, spec: ParamSpec, tp_size: int, tp_rank: int) -> ShardSlice:
    """The slice of `spec` that TP rank tp_rank of tp_size holds."""
    if spec.shard_dim is None or tp_size == 1:
        return ShardSlice(None)
    size = spec.shape[spec.shard_dim]
    if spec.tp_split == "vocab":
        part = config.padded_vocab(tp_size) // tp_size
        start = min(tp_rank * part, size)
        stop = min(start + part, size)
        return ShardSlice(spec.shard_dim, start, stop, part - (stop - start))
    replicas = config.kv_replicas(tp_size)
    if spec.tp_split == "kv_heads" and replicas > 1:
        head = tp_rank // replicas
        return ShardSlice(spec.shard_dim, head * config.head_dim, (head + 1) * config.head_dim)
    start, stop = shard_range(size, tp_size, tp_rank)
    return ShardSlice(spec.shard_dim, start, stop)


def pad_shard(t: torch.Tensor, where: ShardSlice) -> torch.Tensor:
    """`t` (rows [start, stop) of a full tensor) with where.pad zero rows appended."""
    if not where.pad:
        return t
    assert where.dim is not None
    shape = list(t.shape)
    shape[where.dim] = where.pad
    return torch.cat([t, t.new_zeros(shape)], dim=where.dim)


def init_slice(config: ModelConfig, spec: ParamSpec, where: ShardSlice, *,
               device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`where` of one parameter's initial value (padded), made on `device`. Drawn in
    float32 and then cast, so a float64 model holds exactly the values of a float32
    one."""
    shape = list(spec.shape)
    if where.dim is not None:
        shape[where.dim] = where.stop - where.start
    if spec.init in ("ones", "zeros"):
        fill = torch.ones if spec.init == "ones" else torch.zeros
        return pad_shard(fill(shape, dtype=dtype, device=device), where)
    std = config.init_std
    if spec.init == "normal_out":
        std = std / math.sqrt(2 * config.num_layers)
    key = _key(config.seed, spec.tied_to or spec.name)
    part = normal_slice(key, spec.shape, where.dim, where.start, where.stop, device=device)
    return pad_shard(part.mul_(std).to(dtype), where)


def init_shard(
    config: ModelConfig,
    spec: ParamSpec,
    tp_size: int,
    tp_rank: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """This TP rank's slice of the full parameter (the whole tensor if replicated),
    computed alone on `device`."""
    return init_slice(config, spec, tp_slice(config, spec, tp_size, tp_rank),
                      device=device, dtype=dtype)
