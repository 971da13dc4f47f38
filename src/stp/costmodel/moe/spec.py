"""A mixture-of-experts decoder's shape for the cost model, and its all-to-all.

`MoESpec` is a `ModelSpec` whose MoE layers (layer i when (i + 1) %
moe_every == 0, transformers' `decoder_sparse_step`) replace the dense MLP
by a router over `experts` SwiGLU experts of width `expert_ffn`, each token
going to its `top_k`, plus an optional shared expert of width
`shared_expert_ffn` with its sigmoid gate (Qwen2-MoE, "Qwen2 Technical
Report", arXiv 2407.10671; Mixtral, "Mixtral of Experts", arXiv
2401.04088). The decoder's formulas (`stp.costmodel.decoder.spec`) read the MLP
through three hooks, each a mean over the model's layers:

    mlp_width      what a token computes: k x expert_ffn + shared_expert_ffn
                   (FLOPs and the SwiGLU intermediates kept, 1/t per TP rank:
                   stp's experts are TP-sharded like its dense MLP)
    routed_copies  k: the dispatched copies of each token (expert inputs) and
                   the experts' h-wide outputs kept for the routing weights'
                   gradient, 2 bytes a value each (M_B); W reads each copy's
                   input and output gradient (M_W)
    routing_bytes  the router's float32 logits and softmax (8 E bytes a
                   token), the top-k weights (4 k) and indices (8 k)

Routing is taken as balanced: every expert-parallel rank receives k tokens'
worth per token it sends, so its activations are those of one rank without
expert parallelism; a skewed router makes the busiest rank keep more. The
router's own matmul (h x E per token) is left out of the FLOPs (under 0.1%
of a layer at these shapes).

Parameters: the experts (E x 3 h expert_ffn per MoE layer) are split over
`ep` expert-parallel ranks (and over t, as stp shards each expert); the
router, the shared expert, its gate and attention are not
(`ModelSpec.mlp_parameters`); the router and the gate are whole on every TP
rank (`MoESpec.router_parameters`).

The all-to-all (expert parallelism, "GShard", arXiv 2006.16668; the
DeepSeek-V3 report, arXiv 2412.19437, section 3.2): two per MoE layer in F,
dispatch and combine, and their duals in B. Each moves, per EP rank,

    bytes = s b x k x h x w x (ep - 1) / ep

(every token's k copies of h values of w bytes; (ep - 1) / ep of them go
to other ranks under balanced routing). Which link: the EP group is `ep`
consecutive data-parallel ranks, each a TP group of t consecutive GPUs
(stp.runtime.mesh: tp fastest), so it spans t x ep GPUs. The peers within
one node (`node_gpus / t` EP ranks share it) are reached over NVLink
(`tp_bandwidth`), the others over the node's network (`pp_bandwidth`, the
inter-node link); both run at once, so

    T = (ep - 1) x latency + max(local bytes / tp_bandwidth,
                                 remote bytes / pp_bandwidth)

with the inter-node latency when any peer is remote. At t x ep <= 8 (one
node) it is NVLink-bound; past it the network dominates, which is why EP
across nodes is the costly case DualPipe was built to hide. With t > 1
every TP rank dispatches the whole microbatch (its experts' shard needs
every token), so the bytes do not fall with t.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.hardware import HardwareSpec

__all__ = ["MoESpec", "a2a_bytes", "a2a_time", "active_parameters"]


@dataclass(frozen=True)
class MoESpec(ModelSpec):
    """A decoder whose MoE layers route each token to `top_k` of `experts` experts.
    `ffn` is the dense MLP width of the layers that are not MoE layers."""

    experts: int = 8
    """Routed experts E per MoE layer."""
    top_k: int = 2
    """Experts each token goes to (k <= E)."""
    expert_ffn: int = 1
    """SwiGLU inner width of one routed expert."""
    shared_expert_ffn: int = 0
    """Inner width of the shared expert (Qwen2-MoE); 0: none."""
    moe_every: int = 1
    """Layer i is an MoE layer when (i + 1) % moe_every == 0."""
    ep: int = 1
    """Expert-parallel ranks: each holds experts / ep of every MoE layer's experts."""

    _ZERO_OK: ClassVar[tuple[str, ...]] = ("shared_expert_ffn",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k > self.experts:
            raise ValueError(f"model top_k={self.top_k} must be <= experts={self.experts}")
        if self.experts % self.ep:
            raise ValueError(f"model ep={self.ep} must divide experts={self.experts} (each "
                             "expert-parallel rank holds experts / ep)")
        if self.moe_every > self.layers:
            raise ValueError(f"model moe_every={self.moe_every} must be <= layers={self.layers}")
        if not self.gated_mlp:
            raise ValueError("a mixture of experts here has SwiGLU experts (gated_mlp=true)")

    @property
    def moe_fraction(self) -> float:
        """Share of the layers that are MoE layers."""
        return (self.layers // self.moe_every) / self.layers

    @property
    def routed_width(self) -> int:
        """What one token computes in an MoE layer."""
        return self.top_k * self.expert_ffn + self.shared_expert_ffn

    @property
    def mlp_width(self) -> float:
        x = self.moe_fraction
        return (1 - x) * self.ffn + x * self.routed_width

    @property
    def routed_copies(self) -> float:
        return self.moe_fraction * self.top_k

    @property
    def routing_bytes(self) -> float:
        return self.moe_fraction * (8 * self.experts + 12 * self.top_k)

    def mlp_parameters(self) -> tuple[float, float]:
        h, x = self.hidden, self.moe_fraction
        gate = h if self.shared_expert_ffn else 0
        moe_dense = h * self.experts + 3 * h * self.shared_expert_ffn + gate
        dense = (1 - x) * 3 * h * self.ffn + x * moe_dense
        return dense, x * self.experts * 3 * h * self.expert_ffn

    # the decoder's expert-parallel questions (stp.costmodel.decoder.spec), answered

    @property
    def has_experts(self) -> bool:
        return True

    def ep_sizes(self) -> tuple[int, ...]:
        return tuple(n for n in range(1, self.experts + 1) if self.experts % n == 0)

    def with_ep(self, ep: int) -> MoESpec:
        return self if ep == self.ep else replace(self, ep=ep)

    def at_layout_ep(self, ep: int | None, dp: int) -> tuple[MoESpec, str | None]:
        if ep is not None:
            if self.experts % ep:
                raise ValueError(f"ep={ep} must divide the model's {self.experts} experts")
            return replace(self, ep=ep), None
        if dp % self.ep == 0:
            return self, None
        return replace(self, ep=1), (f"{self.name}'s ep={self.ep} does not divide dp={dp}: "
                                     f"priced at ep=1 (give dp a multiple of {self.ep}, or ep)")

    def router_parameters(self) -> float:
        """A layer's router and shared-expert gate (a mean over layers): weights every
        TP rank holds whole (stp.models.moe: replicated over TP)."""
        gate = self.hidden if self.shared_expert_ffn else 0
        return self.moe_fraction * (self.hidden * self.experts + gate)

    @property
    def a2a_copies(self) -> float:
        return float(self.top_k) if self.ep > 1 else 0.0

    def layer_a2a_time(self, hardware: HardwareSpec) -> float:
        """Two all-to-alls per MoE layer (dispatch, combine; B: their duals)."""
        return 2 * self.moe_fraction * a2a_time(self, hardware)

    def kept_extra(self, dtype_bytes: int, tp: int, native_weights: bool) -> float:
        """What the census finds an MoE unit keeping per token beside the dense MLP
        unit's count at the same width, its routed copies and its router (measured,
        stp.costmodel.decoder.kept): 4 w h + 28 bytes (the routed sum's h-wide
        tensors), w h more with a shared expert (its output, kept by the gate's
        product); at t = 1 in float32 with W inside B, none of the 8 h float32 norm
        values the dense unit keeps for autograd's W. At t > 1 the dense count (two
        graphs, full-width partial outputs) already holds the 4 w h + 28: fitted to
        one measured run (`benchmarks/bench_memory.py`, moe-stp-tp2)."""
        w, h = dtype_bytes, self.hidden
        extra = w * h if self.shared_expert_ffn else 0
        if tp == 1:
            extra += 4 * w * h + 28 - (8 * h if native_weights and w == 4 else 0)
        return self.moe_fraction * extra


def active_parameters(spec: MoESpec, *, tied_embeddings: bool = False) -> int:
    """Weights one token passes through: attention, its top-k experts, the shared
    expert and the router (the "active" count model cards give)."""
    h, kd = spec.hidden, spec.kv_heads * spec.head_dim
    dense, experts = spec.mlp_parameters()
    per_layer = h * (h + 2 * kd) + h * h + dense + experts * spec.top_k / spec.experts
    return int(round(spec.layers * per_layer
                     + spec.vocab * h * (1 if tied_embeddings else 2)))


def a2a_bytes(spec: MoESpec, dtype_bytes: int = 2) -> float:
    """Bytes one expert-parallel rank sends in one all-to-all (module doc)."""
    tokens = spec.sequence * spec.micro_batch
    return tokens * spec.top_k * spec.hidden * dtype_bytes * (spec.ep - 1) / spec.ep


def a2a_time(spec: MoESpec, hardware: HardwareSpec, dtype_bytes: int = 2) -> float:
    """Seconds of one all-to-all over the EP group's links (module doc); 0 at ep 1."""
    ep = spec.ep
    if ep <= 1:
        return 0.0
    per_peer = a2a_bytes(spec, dtype_bytes) / (ep - 1)
    per_node = max(1, hardware.node_gpus // spec.tp)  # EP ranks sharing one node
    local = min(ep, per_node) - 1
    remote = ep - 1 - local
    latency = hardware.pp_latency if remote else hardware.tp_latency
    return (ep - 1) * latency + max(local * per_peer / hardware.tp_bandwidth,
                                    remote * per_peer / hardware.pp_bandwidth)

