"""The multimodal model's bytes for `stp.costmodel.memory.estimate`: the parameters
each global stage holds and what one microbatch keeps, per stage, for the simulator.

Parameters (one TP shard, as `stp.models.mllm.stage` builds and shards them;
`stp_runtime=False` counts Qwen2-VL's encoder instead, `stp.costmodel.mllm`):

    stage 0         patch embedding `h_v pd / t` (pd = 3 patch^2 values; Qwen2-VL:
                    two video frames, 6 patch^2), its norm gain `h_v` and
                    learned position table `n h_v` (stp's; Qwen2-VL's rotary
                    positions have none), the text embedding `ceil(V / t) h`
    encoder block   `4 h_v^2 / t + 2 h_v f_v / t + 2 h_v` (two gains)
    merger          with the last block: `mw^2 / t + h mw / t + h_v`, mw = merge^2 h_v
    decoder layer   as the decoder's (`stp.costmodel.decoder.memory.rank_parameters`)
    last stage      the final norm and the output layer `h + ceil(V / t) h`

Kept activations under the `stp` runtime: a census of `stp.models.mllm.vision`'s
units (`stp.runtime.offload`'s count of every storage a forward keeps, once; torch
2.13, float32 and bfloat16, t = 1, recompute none, selective and full), per
microbatch: `P = b I n` patches, `w` the dtype's bytes, `c = max(w, 4)` (norm
statistics in float32), `S = image tokens + text tokens` positions of the packed
`[b, S, h]` stream, `a` encoder heads. `X` is a unit's packed input as its norm
keeps it: when `merge^2 h_v = h` the image rows are a view and keep the whole
input, `b S h w`; otherwise a copy, `P h_v w`. `G`, an encoder output's gradient
as its row-parallel matrix keeps it for W, likewise (`b S h w` or `P h_v w`).

    encoder attention  F to B   X + P h_v (c + 2w + 4w / t) + P c + 4 a P / t
                       B to W   G + P h_v (c + 2w + 4w / t)
    encoder MLP        F to B   X + P h_v (c + 2w) + P c + 2 P f_v w / t
                       B to W   G + P h_v (c + 2w) + 2 P f_v w / t
    merger             F to B   X + P h_v (c + w + 2w / t) + P c + b I' h w   (I' image tokens)
                       B to W   b S h w + P h_v (c + 2w + 2w / t)
    input unit         F to B   P pd w / t + 9 b T + X + P h_v (c + w) + P c
                       B to W   P pd w / t + X + G + 8 b T / t + b T h w / t + P h_v c
    decoder layer, loss head   `stp.costmodel.decoder.kept` over the S positions, with
                       two graphs per unit at every t (its t > 1 terms: the
                       multimodal stage does not fuse a layer at t = 1)

These reproduce the census to the byte at t = 1 (view and copy cases, both
dtypes; `tests/costmodel/test_mllm_memory.py` against built stages). Full
recomputation keeps each encoder unit's and the merger's packed input alone, `b S h
w` (the input unit keeps its small inputs either way); its B-to-W bytes are as
without it. `selective` is taken to keep the same as none (the fused attention
keeps no scores; its log-sum-exp, `4 a P / t`, is in fact dropped). At t > 1 the
terms split by t are the head- and MLP-split tensors (derived from the units'
code, not census-checked). With sequence parallelism `X` and the norms' terms are
this rank's rows (`/ t`), and a unit's TP region and its W read the all-gathered
`[b, S, mw]` rows (text rows zero) through a view of their image rows, so the
gathered tensor, `b S mw w`, stands for the normalised patches and for `G`. The
measured runs of `benchmarks/results/memory.md` (`mllm-` rows: tp 2, with and
without SP) agree to the byte on the rank that peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stp.costmodel.decoder.costs import Derived
from stp.costmodel.decoder.kept import stp_kept
from stp.costmodel.decoder.memory import assemble, layout_schedule
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.inlayer import in_layer_for
from stp.costmodel.memory_types import DTYPE_BYTES, Features, Layout, MemoryEstimate
from stp.costmodel.mllm.costs import derive_mllm, mllm_layered_costs
from stp.costmodel.mllm.spec import CHANNELS, FRAMES_PER_PATCH, MLLMSpec
from stp.schedule.ir import Schedule
from stp.sim.costs import MemCosts, OffloadCosts
from stp.sim.engine import simulate
from stp.sim.layered import check_partition, even_partition
from stp.sim.offload import plan_offload
from stp.sim.result import SimResult
from stp.sim.stages import StageCost, StageCosts

__all__ = ["MLLMKept", "estimate_mllm", "mllm_decoder_spec", "mllm_kept",
           "mllm_stage_parameters", "mllm_stp_table"]


def mllm_decoder_spec(spec: MLLMSpec, *, sequence_parallel: bool = False,
                      recompute: str = "none") -> ModelSpec:
    """The decoder as the runtime builds it, over all `S` positions (text and image
    tokens), its heads as given (not re-split like `mllm.decoder_view`'s)."""
    return ModelSpec(layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                     kv_heads=spec.kv_heads, ffn=spec.ffn, vocab=spec.vocab,
                     sequence=spec.decoder_sequence, micro_batch=spec.micro_batch, tp=spec.tp,
                     gated_mlp=True, flash_attention=True, dropout=False,
                     sequence_parallel=sequence_parallel and spec.tp > 1, recompute=recompute,
                     name=f"{spec.name} decoder")


def _decoder_layer_parameters(dec: ModelSpec) -> float:
    """One TP rank's share of a decoder layer (as `stp.costmodel.decoder.memory`'s): Q and O
    split by t, K and V by t or one kv head per rank, the SwiGLU MLP by t, two gains."""
    h, t, d = dec.hidden, dec.tp, dec.head_dim
    kv = max(dec.kv_heads // t, 1) * d
    return 2 * h * h / t + 2 * h * kv + 3 * h * dec.ffn / t + 2 * h


def mllm_stage_parameters(spec: MLLMSpec, counts: tuple[int, ...], *,
                          stp_runtime: bool = True) -> list[int]:
    """Parameters each global stage holds on one TP rank (the module doc); `counts`:
    layers per stage, encoder blocks first."""
    t, hv, fv, h = spec.tp, spec.vision_hidden, spec.vision_mlp, spec.hidden
    mw = spec.merge**2 * hv
    vocab_rows = -(-spec.vocab // t)
    frames = 1 if stp_runtime else FRAMES_PER_PATCH
    first = (CHANNELS * frames * spec.patch**2 * hv / t + vocab_rows * h
             + ((1 + spec.patches) * hv if stp_runtime else 0))
    block = 4 * hv * hv / t + 2 * hv * fv / t + (2 * hv if stp_runtime else 0)
    merger = mw * mw / t + h * mw / t + (hv if stp_runtime else 0)
    layer = _decoder_layer_parameters(mllm_decoder_spec(spec))
    out: list[int] = []
    start = 0
    for stage, n in enumerate(counts):
        vision = max(0, min(start + n, spec.vision_layers) - start)
        total = vision * block + (n - vision) * layer
        if start < spec.vision_layers <= start + n:
            total += merger
        if stage == 0:
            total += first
        if stage == len(counts) - 1:
            total += h + vocab_rows * h
        out.append(int(round(total)))
        start += n
    return out


@dataclass(frozen=True)
class MLLMKept:
    """Bytes one microbatch keeps on one TP rank, from F until B (`*_b`) and from B
    until W (`*_w`): an encoder block, the merger, stage 0's input unit, a decoder
    layer and the last stage's loss head."""

    block_b: float
    block_w: float
    merger_b: float
    merger_w: float
    input_b: float
    input_w: float
    layer_b: float
    layer_w: float
    last_b: float
    last_w: float


def mllm_kept(spec: MLLMSpec, dtype_bytes: int, *, sequence_parallel: bool = False,
              recompute: str = "none") -> MLLMKept:
    """The census formulas of the module doc for `spec` in a run of `dtype_bytes`."""
    w, c, t = dtype_bytes, max(dtype_bytes, 4), spec.tp
    sp = t if sequence_parallel and t > 1 else 1
    b, hv, fv, h = spec.micro_batch, spec.vision_hidden, spec.vision_mlp, spec.hidden
    patches = b * spec.images * spec.patches  # P
    stream = b * spec.decoder_sequence * h * w  # the packed [b, S, h] tensor
    text = b * spec.sequence
    view = spec.merge**2 * hv == h
    x = (stream if view else patches * hv * w) / sp
    # under SP a unit's TP region reads the all-gathered [b, S, mw] rows (text rows
    # zero) through a view of its image rows: the whole gathered tensor stays
    gathered = b * spec.decoder_sequence * spec.merge**2 * hv * w
    h_in = gathered if sp > 1 else patches * hv * w
    grad = gathered if sp > 1 else stream if view else patches * hv * w
    norm = patches * (hv * c + c) / sp  # xhat and rstd, float32 at least
    # the normalised patches: this rank's rows, and under SP the gathered ones too
    normed = patches * hv * w / sp + (gathered if sp > 1 else 0)
    lse = 4 * spec.vision_heads * patches / t  # the fused attention's float32 log-sum-exp
    attn_b = x + norm + normed + patches * hv * w * (4 / t + 1) + lse
    mlp_b = x + norm + normed + patches * hv * w + 2 * patches * fv * w / t
    merger_b = (x + norm + normed + 2 * patches * hv * w / t
                + b * spec.image_tokens * h * w)
    if recompute == "full":  # each unit keeps its packed input rows alone
        attn_b = mlp_b = merger_b = stream / sp
    dnorm = patches * hv * (c + w) / sp  # the gain's W: xhat and the norm's output gradient
    attn_w = grad + h_in + 4 * patches * hv * w / t + dnorm
    mlp_w = grad + h_in + 2 * patches * fv * w / t + dnorm
    merger_w = stream + h_in + 2 * patches * hv * w / t + dnorm
    pixels = patches * CHANNELS * spec.patch**2 * w / t
    input_b = pixels + 9 * text + x + patches * hv * w / sp + norm
    input_w = (pixels + (stream if view else patches * hv * w) + x + 8 * text / t
               + text * h * w / t + patches * hv * c / sp)
    dec = stp_kept(mllm_decoder_spec(spec, sequence_parallel=sequence_parallel,
                                     recompute=recompute), w, two_graphs=True)
    return MLLMKept(attn_b + mlp_b, attn_w + mlp_w, merger_b, merger_w, input_b, input_w,
                    dec.layer_b, dec.layer_w, dec.last_b, dec.last_w)


def mllm_stp_table(spec: MLLMSpec, hardware: HardwareSpec, pp: int, dtype_bytes: int,
                   counts: tuple[int, ...], *, sequence_parallel: bool = False,
                   recompute: str = "none") -> tuple[StageCosts, MemCosts, float, Derived]:
    """The stage table of `spec` for the simulator with what stp's units keep
    (`mllm_kept`): the multimodal cost model's times (`mllm_costs`), each part's bytes
    in units of one rank's share of the model's layers (encoder blocks, merger,
    decoder layers: the returned bytes per unit). Without full recomputation a W's
    bytes are capped at what its B freed (as the decoder's table, `stp.costmodel.decoder.memory`);
    with it, B rebuilds the units and allocates the rest."""
    derived = derive_mllm(spec, hardware, pp)
    layered = mllm_layered_costs(spec, hardware, pp, derived.costs, derived.mem)
    k = mllm_kept(spec, dtype_bytes, sequence_parallel=sequence_parallel, recompute=recompute)
    unit = (spec.vision_layers * k.block_b + k.merger_b + spec.layers * k.layer_b) / pp
    cap = (lambda m_w, m_b: m_w) if recompute == "full" else min

    def kept(c: StageCost, m_b: float, m_w: float) -> StageCost:
        return replace(c, mem_b=m_b / unit, mem_w=cap(m_w, m_b) / unit)

    layered = replace(layered, vision=kept(layered.vision, k.block_b, k.block_w),
                      merger=kept(layered.merger, k.merger_b, k.merger_w),
                      layer=kept(layered.layer, k.layer_b, k.layer_w),
                      first=kept(layered.first, k.input_b, k.input_w),
                      last=kept(layered.last, k.last_b, k.last_w))
    total_w = spec.vision_layers * k.block_w + k.merger_w + spec.layers * k.layer_w
    mem = MemCosts(m_b=1.0, m_w=min(1.0, total_w / pp / unit))
    return layered.table(counts), mem, unit, derived


def estimate_mllm(spec: MLLMSpec, hardware: HardwareSpec, layout: Layout,
                  features: Features = Features(), schedule: Schedule | None = None
                  ) -> tuple[MemoryEstimate, SimResult]:
    """`stp.costmodel.memory.estimate_run` for a multimodal model: its parameters per
    stage and, under the `stp` runtime, what its units keep (above); under `megatron`
    Qwen2-VL's encoder and Korthikanti's bytes (stp.costmodel.mllm.costs). The
    layout's seq_len is the text tokens of a sample (the decoder sees the image
    tokens too); the buffers are those of the decoder-wide packed stream."""
    if layout.ep not in (None, 1):
        raise ValueError(f"ep={layout.ep}: expert parallelism needs a mixture-of-experts "
                         f"model; {spec.name} has no experts")
    spec = replace(spec, tp=layout.tp, sequence=layout.seq_len,
                   micro_batch=layout.microbatch_size)
    sch = layout_schedule(layout, schedule)
    if spec.total_layers < sch.num_stages:
        raise ValueError(f"the model's {spec.vision_layers} vision + {spec.layers} decoder "
                         f"layers cannot fill {sch.num_stages} stages of {layout.schedule} at "
                         f"pp={layout.pp}")
    counts = (even_partition(spec.total_layers, sch.num_stages) if layout.partition is None
              else check_partition(layout.partition, sch.num_stages, spec.total_layers))
    width, stp = DTYPE_BYTES[features.dtype], features.runtime == "stp"
    sp = features.sequence_parallel and layout.tp > 1
    notes = []
    if stp:
        table, mem, unit, derived = mllm_stp_table(
            spec, hardware, layout.pp, width, counts, sequence_parallel=sp,
            recompute=features.recompute)
        if sp:
            notes.append("with sequence parallelism the vision encoder's kept bytes are "
                         "derived, not census-checked (stp.costmodel.mllm.memory)")
    else:
        derived = derive_mllm(spec, hardware, layout.pp)
        table = mllm_layered_costs(spec, hardware, layout.pp, derived.costs,
                                   derived.mem).table(counts)
        mem, unit = derived.mem, derived.bytes_per_unit * width / 2
        if sp or features.recompute != "none":
            notes.append("the multimodal model's activation formulas (stp.costmodel.mllm) "
                         "count neither sequence parallelism nor recomputation")
    oc = OffloadCosts(bandwidth=hardware.host_bandwidth / 1e3, act_bytes=unit)
    plan = plan_offload(sch, features.offload, derived.costs, mem, oc, stages=table)
    res = simulate(sch, derived.costs, mem, offload=plan if len(plan) else None,
                   offload_costs=oc, record_spans=False, stages=table, braid=features.braid,
                   in_layer=in_layer_for(spec, hardware, features.tp_overlap_chunks))
    stage_params = mllm_stage_parameters(spec, counts, stp_runtime=stp)
    params = [0] * sch.num_ranks
    for stage, n in enumerate(stage_params):
        params[sch.stage_to_rank[stage]] += n
    dec = mllm_decoder_spec(spec, sequence_parallel=sp, recompute=features.recompute)
    est = assemble(dec, res, unit, features, replace(layout, partition=counts, ep=None),
                    (params, [0] * sch.num_ranks), (stage_params, [0] * len(stage_params)))
    return replace(est, notes=(*est.notes, *notes)), res
