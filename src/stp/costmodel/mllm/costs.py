"""A multimodal model's costs for the simulator: one rank's share, and each
global stage's own costs when a partition cuts encoder and decoder.

Layers are counted together, encoder blocks first: global layers
0..vision_layers-1 are encoder blocks, the rest decoder layers (as `stp
train --arch mllm` cuts them). One microbatch, one TP rank:

    encoder block   `stp.costmodel.mllm` (F, B, W, M_B, M_W); two all-reduces
                    of its n I b h_v output per pass (Megatron TP after
                    attention and after the MLP)
    merger          on the stage of the last encoder block: F = B = W the
                    merger's matmuls, one all-reduce of its s_img b h output
                    per pass, its input (4 merge^2 n I b h_v / merge^2 bytes:
                    input and hidden, 16-bit) kept
    decoder layer   `stp.costmodel.decoder.spec` over `sequence + image tokens`
                    positions
    first stage     the token embedding (`stp.costmodel.stages`) and the
                    patch embedding (F and W), keeping the pixels' patches
    last stage      the output layer and the loss (`stp.costmodel.stages`)

Between stages the hidden state is decoder-wide over all positions (the
runtime packs the encoder's state into it), so every send costs the same.
The uniform share (`derive_mllm`) is the whole model's work over `pp` ranks;
its M_B is the memory unit of every table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from stp.costmodel.decoder.costs import (
    Derived,
    decoder_model_flops,
    derive_decoder,
    edge_costs,
    head_flops,
)
from stp.costmodel.decoder.spec import layer_activation_bytes, layer_flops
from stp.costmodel.hardware import HardwareSpec, allreduce_time, p2p_time
from stp.costmodel.mllm.spec import (
    MLLMSpec,
    decoder_view,
    merger_flops,
    patch_embed_flops,
    vision_layer_bytes,
    vision_layer_flops,
)
from stp.schedule.memory import MemCosts
from stp.sim.costs import Costs
from stp.sim.layered import LayeredCosts
from stp.sim.stages import StageCost, StageCosts

__all__ = ["MixedLayeredCosts", "check_mllm_partition", "derive_mllm", "mllm_layered_costs",
           "mllm_model_flops"]


def _ar_ms(num_bytes: float, spec: MLLMSpec, hw: HardwareSpec) -> float:
    return allreduce_time(num_bytes, spec.tp, hw.tp_bandwidth, hw.tp_latency) * 1e3


def _vision_block(spec: MLLMSpec, hw: HardwareSpec) -> tuple[StageCost, float]:
    """(one encoder block in ms and bytes, its M_B bytes)."""
    ms = 1e3 / hw.achieved_flops
    f, b, w = vision_layer_flops(spec)
    m_b, m_w = vision_layer_bytes(spec)
    out = 2.0 * spec.images * spec.patches * spec.micro_batch * spec.vision_hidden
    ar = 2 * _ar_ms(out, spec, hw)
    return StageCost(f * ms, b * ms, w * ms, ar, None, m_b, m_w), m_b


def _decoder_layer(spec: MLLMSpec, hw: HardwareSpec) -> StageCost:
    view = decoder_view(spec)
    ms = 1e3 / hw.achieved_flops
    f, b, w = layer_flops(view)
    m_b, m_w = layer_activation_bytes(view)
    out = 2.0 * view.sequence * view.micro_batch * view.hidden
    return StageCost(f * ms, b * ms, w * ms, 2 * _ar_ms(out, spec, hw), None, m_b, m_w)


def _merger(spec: MLLMSpec, hw: HardwareSpec) -> StageCost:
    t = merger_flops(spec) / hw.achieved_flops * 1e3
    wide = spec.merge**2 * spec.vision_hidden
    kept = 2.0 * 2 * spec.image_tokens * spec.micro_batch * wide / spec.tp
    out = 2.0 * spec.image_tokens * spec.micro_batch * spec.hidden
    return StageCost(t, t, t, _ar_ms(out, spec, hw), None, kept, kept)


def _patch_embed(spec: MLLMSpec, hw: HardwareSpec) -> StageCost:
    t = patch_embed_flops(spec) / hw.achieved_flops * 1e3
    pixels = 2.0 * spec.images * spec.micro_batch * 3 * 2 * spec.resolution**2
    return StageCost(t, 0.0, t, 0.0, None, pixels, pixels)


def _scaled(c: StageCost, time: float, mem: float) -> StageCost:
    ar_b = None if c.ar_b is None else c.ar_b * time
    return StageCost(c.f * time, c.b * time, c.w * time, c.ar * time, ar_b, c.mem_b * mem,
                     c.mem_w * mem, c.units)


def _total(cs: Sequence[tuple[StageCost, int]]) -> StageCost:
    return StageCost(*(sum(getattr(c, k) * n for c, n in cs) for k in ("f", "b", "w", "ar")),
                     None, sum(c.mem_b * n for c, n in cs), sum(c.mem_w * n for c, n in cs))


def derive_mllm(spec: MLLMSpec, hardware: HardwareSpec, pp: int) -> Derived:
    """Per-rank costs of the whole model (encoder, merger, decoder layers)
    over `pp` ranks: `stp.costmodel.derive.derive` for a multimodal model."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline size pp={pp!r} must be an integer >= 1")
    if pp > spec.total_layers:
        raise ValueError(f"pp={pp} exceeds the model's {spec.total_layers} layers "
                         f"({spec.vision_layers} vision + {spec.layers} decoder)")
    block, _ = _vision_block(spec, hardware)
    parts = [(block, spec.vision_layers), (_merger(spec, hardware), 1),
             (_decoder_layer(spec, hardware), spec.layers)]
    share = _scaled(_total(parts), 1 / pp, 1 / pp)
    view = decoder_view(spec)
    sent = 2.0 * view.sequence * view.micro_batch * view.hidden
    comm = p2p_time(sent, hardware.pp_bandwidth, hardware.pp_latency) * 1e3
    costs = Costs(f=share.f, b=share.b, w=share.w, ar=share.ar, comm=comm)
    flops = tuple(x * hardware.achieved_flops / 1e3 for x in (share.f, share.b, share.w))
    head = head_flops(view) / hardware.achieved_flops * 1e3
    offload = (share.mem_b / hardware.host_bandwidth * 1e3) / (share.f + share.b + share.w)
    return Derived(costs=costs, mem=MemCosts(m_b=1.0, m_w=share.mem_w / share.mem_b),
                   bytes_per_unit=share.mem_b, layers_per_rank=spec.total_layers / pp,
                   flops_per_rank=(flops[0], flops[1], flops[2]),
                   lm_head_ms=head, offload_ratio=offload)


@dataclass(frozen=True)
class MixedLayeredCosts(LayeredCosts):
    """`LayeredCosts` whose first `num_vision` layers are encoder blocks
    (`vision`), the rest decoder layers (`layer`); the merger rides with the
    last encoder block."""

    vision: StageCost = StageCost(0.0, 0.0, 0.0)
    num_vision: int = 0
    merger: StageCost = StageCost(0.0, 0.0, 0.0)

    def stage_at(self, index: int, num_stages: int, start: int, layers: int) -> StageCost:
        """Stage `index` holding global layers start..start+layers-1."""
        vis = max(0, min(start + layers, self.num_vision) - start)
        parts = [(self.vision, vis), (self.layer, layers - vis)]
        if start < self.num_vision <= start + layers:
            parts.append((self.merger, 1))
        if index == 0:
            parts.append((self.first, 1))
        if index == num_stages - 1:
            parts.append((self.last, 1))
        ar_b = sum(c.ar_backward * n for c, n in parts)
        return replace(_total(parts), ar_b=ar_b, units=self.units)

    def table(self, counts: Sequence[int]) -> StageCosts:
        starts = [sum(counts[:s]) for s in range(len(counts))]
        n = len(counts)
        rows = tuple(self.stage_at(s, n, starts[s], c) for s, c in enumerate(counts))
        return StageCosts(rows, self.comm, tuple(counts))

    def stage(self, index: int, num_stages: int, layers: int) -> StageCost:
        """Without its start a stage is costed as `stage_time` assumes."""
        return self.stage_at(index, num_stages, 0 if index == 0 else self.num_vision, layers)

    def stage_time(self, index: int, num_stages: int, layers: int) -> float:
        """Compute of a stage not knowing where it starts (the balanced
        partition's question): stage 0 starts with the encoder, a later stage
        is taken to hold decoder layers only. Exact whenever stage 0 holds the
        whole encoder, as it does when the encoder costs less than the
        decoder's share of a stage; the simulator-judged moves of `--partition
        auto` see the true costs of every other partition."""
        return self.stage(index, num_stages, layers).compute


def mllm_layered_costs(spec: MLLMSpec, hardware: HardwareSpec, pp: int, costs: Costs,
                       mem: MemCosts, layers: int = 1) -> MixedLayeredCosts:
    """Per-layer costs of `spec` in ms and units of `derive_mllm`'s M_B;
    `costs`/`mem` (what --cost/--mem made of the derived share) scale every
    layer by the same ratio as they scale the share."""
    d = derive_mllm(spec, hardware, pp)
    unit = d.bytes_per_unit
    time = {k: getattr(costs, k) / getattr(d.costs, k) if getattr(d.costs, k) else 1.0
            for k in ("f", "b", "w", "ar")}
    mem_ratio = mem.m_b / d.mem.m_b

    def fit(c: StageCost, bytes_scale: float = 1 / unit) -> StageCost:
        ar_b = None if c.ar_b is None else c.ar_b * time["ar"]
        return StageCost(c.f * time["f"], c.b * time["b"], c.w * time["w"], c.ar * time["ar"],
                         ar_b, c.mem_b * bytes_scale * mem_ratio,
                         c.mem_w * bytes_scale * mem_ratio)

    view = decoder_view(spec)
    # edge_costs states memory in the decoder-only view's unit and edge_scale turns it
    # back into bytes / ours, so the view's pp cancels out; capped at the decoder's
    # layers, as the view alone cannot have more stages than layers (the encoder's
    # blocks fill the rest of the pipeline)
    view_pp = min(pp, view.layers)
    embed, head = edge_costs(view, hardware, view_pp)
    # their units -> ours
    edge_scale = derive_decoder(view, hardware, view_pp).bytes_per_unit / unit
    first = _total([(fit(embed, edge_scale), 1), (fit(_patch_embed(spec, hardware)), 1)])
    first = replace(first, ar_b=0.0)
    block, _ = _vision_block(spec, hardware)
    return MixedLayeredCosts(
        layer=fit(_decoder_layer(spec, hardware)), first=first, last=fit(head, edge_scale),
        comm=costs.comm, units=2 * layers, num_layers=spec.total_layers,
        vision=fit(block), num_vision=spec.vision_layers, merger=fit(_merger(spec, hardware)),
    )


def check_mllm_partition(spec: MLLMSpec, counts: tuple[int, ...]) -> None:
    """An explicit partition counts encoder blocks and decoder layers together; say so
    when the counts miss the total."""
    if sum(counts) != spec.total_layers:
        shown = ",".join(map(str, counts))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(f"--partition {shown} sums to {sum(counts)} layers but {spec.name} has "
                         f"{spec.vision_layers} vision + {spec.layers} decoder = "
                         f"{spec.total_layers}; count both, vision layers first")


def mllm_model_flops(spec: MLLMSpec) -> float:
    """Training FLOPs of one microbatch of the whole multimodal model, unsharded, no
    recomputation: the decoder over text and image positions (`decoder_model_flops`),
    every encoder block's F, B and W, the merger's three passes and the patch
    embedding's F and W (the pixels need no gradient)."""
    one = replace(spec, tp=1)
    blocks = spec.vision_layers * sum(vision_layer_flops(one))
    return (decoder_model_flops(decoder_view(one)) + blocks + 3 * merger_flops(one)
            + 2 * patch_embed_flops(one))
