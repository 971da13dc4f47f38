"""Bytes per pipeline rank: model states, peak activations, communication buffers.

`estimate(model, hardware, layout, features)` prices one training step of a
decoder cut into `layout.pp` pipeline ranks, `tp` tensor-parallel and `dp`
data-parallel ranks. Every TP and DP peer of a pipeline rank holds the same
bytes, so a rank here is a pipeline rank. Per rank, with `P` the parameters
it holds (one TP shard of its stages' layers, the vocab-parallel embedding
on the first stage, the final norm and output layer on the last):

    weights      P x the compute dtype's bytes (2 for bfloat16)
    grads        P x 4 in a 16-bit run: stp, like Megatron-LM, adds each
                 microbatch's weight gradient into an fp32 buffer per
                 parameter; P x the dtype's bytes otherwise
    masters      fp32 master weights, P x 4, in a 16-bit run; 0 in float32
                 or float64 (the weights are the masters)
    optimizer    AdamW's two moments, P x 8 in fp32 (P x 16 in float64)
    with a sharded optimizer (ZeRO stage 1, Rajbhandari et al., "ZeRO:
    Memory Optimizations Toward Training Trillion Parameter Models", arXiv
    1910.02054, section 5.1: `4 Psi + 12 Psi / N_d` with 16-bit gradients;
    masters too, as Megatron-LM's distributed optimizer) masters and
    optimizer are divided by dp.
    experts      a mixture of experts (`stp.costmodel.moe`) with `ep`
                 expert-parallel ranks (carved from the dp ranks: ep divides
                 dp): each rank holds 1/ep of every MoE layer's experts
                 (`P_e`, in P above), replicated over the dp/ep ranks of its
                 expert-data-parallel group, so the sharded optimizer divides
                 their masters and moments by dp/ep, not dp (the rest of P by
                 dp).
    activations  the simulator's peak of resident activations on the rank
                 (`stp.sim.simulate` under the model's per-stage costs, so
                 the schedule, offload, recomputation and sequence
                 parallelism count; `stp.costmodel.decoder.spec` for the per-layer
                 formulas), in bytes; scaled by dtype bytes / 2, the
                 formulas being for 16-bit activations.
    buffers      point-to-point receive buffers: one activation and one
                 gradient per stage the rank holds, `s b h` values each
                 (`/ t` with sequence parallelism); the all-gathered input of
                 a unit with sequence parallelism, `s b h`, for each of the
                 two passes a braided block runs at once; with a sharded
                 optimizer, the reduce-scattered fp32 gradient shard `4 P /
                 dp` (experts' over dp/ep); with ep > 1, one all-to-all's send
                 and receive buffers, `s b k h` each, for each of two passes;
                 with dp > 1, what the DP gradient reductions' flat copies add
                 to the activations' peak (below; in a 16-bit run the main
                 grads are reduced in place and only the sharded optimizer's
                 per-stage segments are held). TP all-reduces run in place and are not counted,
                 nor is the allocator's fragmentation or the CUDA context.

A multimodal model (`stp.costmodel.mllm.MLLMSpec`) is priced the same way with
its own parts (`_estimate_mllm`, stp.costmodel.mllm.memory): the vision encoder,
merger and patch embedding's parameters on the stages that hold them, and what
their units keep (`stp`) or Korthikanti's formulas over the patches (`megatron`);
the buffers are those of the decoder-wide packed stream.

The DP gradient reductions' flat copies and what they add to the peak:
stp.costmodel.dp_copies (`RankMemory.copies`, `dp_copies` in `stp memory
--json`'s ranks; an upper bound, at most 5% of the total over on the small
runs of benchmarks/results/memory.md).

Whose activations (`Features.runtime`): `megatron`, Korthikanti's counting
(`stp.costmodel.decoder.spec`; `stp memory --model`), or `stp`, what stp's own
decoder units keep (`stp.costmodel.decoder.kept`, a census of the runtime's saved
tensors; the estimate of a `stp train` run, `stp.train.run.memory_check`). The
two differ: torch's scaled_dot_product_attention keeps no s x s scores, but
stp's units keep the rotated q and k, each unit's output before its
all-reduce and all four SwiGLU intermediates, and float32 norm values.
Against `stp train --json`'s measurement (`stp.train.run.memory_measure`;
`benchmarks/bench_memory.py`, `benchmarks/results/memory.md`) the `stp`
estimate's model states agree to the byte (AdamW's step counters aside) and
its activations on the rank that peaks to the byte on the small models
measured there; on a rank whose deferred W's output gradients outweigh what
B freed, a few percent low (capped: B frees). With full recomputation and W
deferred, B rebuilds a unit and its W keeps many times what F kept: there the
stage table lets B allocate the rest (`StageCost.mem_w` above `mem_b`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.costs import Derived, derive_decoder, edge_costs
from stp.costmodel.dp_copies import copies_over_peak, reduction_copies
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.decoder.kept import Kept, stp_kept
from stp.costmodel.memory_types import (
    CATEGORIES,
    DTYPE_BYTES,
    Features,
    Layout,
    MemoryEstimate,
    RankMemory,
)
from stp.costmodel.mllm.spec import MLLMSpec
from stp.costmodel.mllm.costs import derive_mllm, mllm_layered_costs
from stp.costmodel.mllm.memory import mllm_decoder_spec, mllm_stage_parameters, mllm_stp_table
from stp.costmodel.decoder.spec import ModelSpec, decoder_only
from stp.costmodel.moe.spec import MoESpec, router_parameters
from stp.costmodel.stages import layered_costs
from stp.schedule.ir import Kind, Schedule, passes_of
from stp.schedule.registry import generate
from stp.shapes import ModelConfig
from stp.sim.costs import MemCosts, OffloadCosts
from stp.sim.engine import simulate
from stp.sim.layered import LayeredCosts, check_partition, even_partition
from stp.sim.offload import plan_offload
from stp.sim.result import SimResult
from stp.sim.stages import StageCosts
from stp.sim.table import program_peaks

__all__ = ["DTYPE_BYTES", "CATEGORIES", "Layout", "Features", "RankMemory", "MemoryEstimate",
           "estimate", "estimate_run", "format_bytes", "memory_of_run", "rank_parameters",
           "simulate_run", "states_bound"]

def _layer_parameters(spec: ModelSpec) -> float:
    """One TP rank's share of a layer: Q and O split by t; K and V split by t,
    or one kv head per rank when there are fewer kv heads than ranks (each is
    replicated); the MLP split by t (a mixture of experts' experts by ep too);
    the two norms replicated."""
    h, t, d = spec.hidden, spec.tp, spec.head_dim
    kv_per_rank = max(spec.kv_heads // t, 1) * d
    dense, _ = spec.mlp_parameters()
    router = router_parameters(spec)  # whole on every TP rank
    return (2 * h * h / t + 2 * h * kv_per_rank + (dense - router) / t + router
            + _layer_experts(spec) + 2 * h)


def _layer_experts(spec: ModelSpec) -> float:
    """One rank's share of a layer's expert weights: 1/ep of the experts, each split by t."""
    return spec.mlp_parameters()[1] / spec.tp / (spec.ep if isinstance(spec, MoESpec) else 1)


def rank_parameters(spec: ModelSpec, num_stages: int, stage_to_rank: tuple[int, ...],
                    counts: tuple[int, ...], *, experts_only: bool = False) -> list[int]:
    """Parameters each pipeline rank holds (one TP shard): its stages' layers, the
    vocab-parallel embedding on stage 0, the final norm and output layer on the
    last stage (both padded to a multiple of t, as the runtime pads them).
    `experts_only`: of those, a mixture of experts' routed experts (1/ep of them)."""
    vocab_rows = -(-spec.vocab // spec.tp)
    out = [0.0] * (max(stage_to_rank) + 1)
    for stage in range(num_stages):
        rank = stage_to_rank[stage]
        if experts_only:
            out[rank] += counts[stage] * _layer_experts(spec)
            continue
        out[rank] += counts[stage] * _layer_parameters(spec)
        if stage == 0:
            out[rank] += vocab_rows * spec.hidden
        if stage == num_stages - 1:
            out[rank] += vocab_rows * spec.hidden + spec.hidden
    return [int(round(x)) for x in out]


def estimate(model: ModelSpec | MLLMSpec | ModelConfig, hardware: HardwareSpec, layout: Layout,
             features: Features = Features(), schedule: Schedule | None = None
             ) -> MemoryEstimate:
    """Bytes per pipeline rank of a training step (module doc). See `estimate_run`."""
    return estimate_run(model, hardware, layout, features, schedule)[0]


def estimate_run(model: ModelSpec | MLLMSpec | ModelConfig, hardware: HardwareSpec, layout: Layout,
                 features: Features = Features(), schedule: Schedule | None = None
                 ) -> tuple[MemoryEstimate, SimResult]:
    """`estimate`, and the simulated step it read the activations from (the planner,
    `stp.plan`, ranks by that step and explains it by its parts). Bytes per pipeline
    rank of a training step (module doc). `model` is a
    cost-model spec (a multimodal `MLLMSpec` too: `_estimate_mllm`) or the
    `ModelConfig` a run builds (`stp.costmodel.configs`);
    its tp, sequence, micro_batch, sequence_parallel and recompute are taken
    from `layout` and `features`. `schedule`: the one to simulate (a schedule
    file's); None generates `layout.schedule` for `layout.pp` and `microbatches`."""
    if isinstance(model, ModelConfig):
        model = spec_from_config(model, seq_len=layout.seq_len)
    if isinstance(model, MLLMSpec):
        return _estimate_mllm(model, hardware, layout, features, schedule)
    spec, res, unit, ep_note = simulate_run(model, hardware, layout, features, schedule)
    # memory_of_run takes a 16-bit unit and scales it by the dtype
    est = memory_of_run(spec, res, unit * 2 / DTYPE_BYTES[features.dtype], features,
                        dp=layout.dp)
    if isinstance(spec, MoESpec):
        est = replace(est, layout=replace(est.layout, ep=spec.ep))
    return (replace(est, notes=(*est.notes, ep_note)) if ep_note else est), res


def simulate_run(model: ModelSpec, hardware: HardwareSpec, layout: Layout,
                 features: Features = Features(), schedule: Schedule | None = None
                 ) -> tuple[ModelSpec, SimResult, float, str | None]:
    """The simulated half of `estimate_run` for a decoder spec: (the spec as the
    layout cuts it, the simulated step, the activation unit in bytes of
    `features.dtype`, a note on ep or None). `features.shard_optimizer` does
    not enter it (it changes model states only), so the planner reuses one
    simulation across it (`stp.plan.price`)."""
    spec, sch, derived, table, mem, unit, ep_note = _prepared(model, hardware, layout, features,
                                                             schedule)
    copied = unit if features.runtime == "stp" else derived.bytes_per_unit
    oc = OffloadCosts(bandwidth=hardware.host_bandwidth / 1e3, act_bytes=copied)
    plan = plan_offload(sch, features.offload, derived.costs, mem, oc, stages=table)
    res = simulate(sch, derived.costs, mem, offload=plan if len(plan) else None,
                   offload_costs=oc, record_spans=False, stages=table)
    return spec, res, unit, ep_note


def states_bound(model: ModelSpec, hardware: HardwareSpec, layout: Layout,
                 features: Features, schedule: Schedule | None = None) -> list[float] | None:
    """Bytes per pipeline rank of `estimate_run` without simulating, less only
    the gradient copies it adds over the activation peak (`dp_copies`, >= 0):
    the same model states and buffers, and the activation peaks walked in
    program order (`stp.sim.table.program_peaks`), which is the simulator's
    peak when nothing is offloaded. So each is a lower bound of that rank's
    estimate (the planner prunes by it, `stp.plan.price`); None with offload,
    whose copies move activations in time."""
    if features.offload != "none":
        return None
    spec, sch, _, table, _, unit, _ = _prepared(model, hardware, layout, features, schedule)
    counts = table.partition or even_partition(spec.layers, sch.num_stages)
    params = rank_parameters(spec, sch.num_stages, sch.stage_to_rank, tuple(counts))
    experts = rank_parameters(spec, sch.num_stages, sch.stage_to_rank, tuple(counts),
                              experts_only=True)
    peaks = program_peaks(sch, table)
    return [_rank(r, n, peaks[r] * unit, spec, sch.chunks, layout, features, experts[r]).total
            for r, n in enumerate(params)]


def _prepared(model: ModelSpec, hardware: HardwareSpec, layout: Layout, features: Features,
              schedule: Schedule | None) -> tuple:
    """What a simulation of the layout reads: (spec cut as the layout cuts it, the
    schedule, the derived costs, the per-stage table, the memory costs, the
    activation unit in bytes, a note on ep or None)."""
    model = decoder_only(model, "a memory estimate")
    model, ep_note = _with_ep(model, layout)
    spec = replace(model, tp=layout.tp, sequence=layout.seq_len,
                   micro_batch=layout.microbatch_size,
                   sequence_parallel=features.sequence_parallel, recompute=features.recompute)
    sch = _the_schedule(layout, schedule)
    if spec.layers < sch.num_stages:
        raise ValueError(f"the model's {spec.layers} layers cannot fill {sch.num_stages} "
                         f"stages of {layout.schedule} at pp={layout.pp}")
    derived = derive_decoder(spec, hardware, layout.pp)
    counts = (even_partition(spec.layers, sch.num_stages) if layout.partition is None
              else check_partition(layout.partition, sch.num_stages, spec.layers))
    if features.runtime == "stp":
        table, mem, unit = _stp_table(spec, hardware, layout.pp, derived, features.dtype,
                                      sch, counts)
    else:  # Korthikanti's bytes are for 16-bit activations (module doc)
        layered = layered_costs(spec, hardware, layout.pp, derived.costs, derived.mem)
        mem, unit = derived.mem, derived.bytes_per_unit * DTYPE_BYTES[features.dtype] / 2
        table = layered.table(counts)
    return spec, sch, derived, table, mem, unit, ep_note


def _the_schedule(layout: Layout, schedule: Schedule | None) -> Schedule:
    """`schedule` (checked against the layout's pp and m), or the layout's generated."""
    opts = {} if layout.chunks is None else {"chunks": layout.chunks}
    sch = schedule or generate(layout.schedule, layout.pp, layout.microbatches, **opts)
    if (sch.num_ranks, sch.num_microbatches) != (layout.pp, layout.microbatches):
        raise ValueError(f"schedule {sch.name}: {sch.num_ranks} ranks x {sch.num_microbatches} "
                         f"microbatches, but the layout is pp={layout.pp} "
                         f"m={layout.microbatches}")
    return sch


def _estimate_mllm(spec: MLLMSpec, hardware: HardwareSpec, layout: Layout, features: Features,
                   schedule: Schedule | None) -> tuple[MemoryEstimate, SimResult]:
    """`estimate_run` for a multimodal model: its parameters per stage and, under the
    `stp` runtime, what its units keep (stp.costmodel.mllm.memory); under `megatron`
    Qwen2-VL's encoder and Korthikanti's bytes (stp.costmodel.mllm.costs). The
    layout's seq_len is the text tokens of a sample (the decoder sees the image
    tokens too); the buffers are those of the decoder-wide packed stream."""
    if layout.ep not in (None, 1):
        raise ValueError(f"ep={layout.ep}: expert parallelism needs a mixture-of-experts "
                         f"model; {spec.name} has no experts")
    spec = replace(spec, tp=layout.tp, sequence=layout.seq_len,
                   micro_batch=layout.microbatch_size)
    sch = _the_schedule(layout, schedule)
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
                   offload_costs=oc, record_spans=False, stages=table)
    stage_params = mllm_stage_parameters(spec, counts, stp_runtime=stp)
    params = [0] * sch.num_ranks
    for stage, n in enumerate(stage_params):
        params[sch.stage_to_rank[stage]] += n
    dec = mllm_decoder_spec(spec, sequence_parallel=sp, recompute=features.recompute)
    est = _assemble(dec, res, unit, features, replace(layout, partition=counts, ep=None),
                    (params, [0] * sch.num_ranks), (stage_params, [0] * len(stage_params)))
    return replace(est, notes=(*est.notes, *notes)), res


def _with_ep(model: ModelSpec, layout: Layout) -> tuple[ModelSpec, str | None]:
    """`model` at the layout's expert parallelism (`Layout.ep`), and a note when a
    spec's own ep was set aside for not dividing dp."""
    if not isinstance(model, MoESpec):
        if layout.ep not in (None, 1):
            raise ValueError(f"ep={layout.ep}: expert parallelism needs a mixture-of-experts "
                             f"model; {model.name} has no experts")
        return model, None
    if layout.ep is not None:
        if model.experts % layout.ep:
            raise ValueError(f"ep={layout.ep} must divide the model's {model.experts} experts")
        return replace(model, ep=layout.ep), None
    if layout.dp % model.ep == 0:
        return model, None
    return replace(model, ep=1), (f"{model.name}'s ep={model.ep} does not divide dp="
                                  f"{layout.dp}: priced at ep=1 (give dp a multiple of "
                                  f"{model.ep}, or ep)")


def _stp_table(spec: ModelSpec, hardware: HardwareSpec, pp: int, derived: Derived, dtype: str,
               sch: Schedule, counts: tuple[int, ...]) -> tuple[StageCosts, MemCosts, float]:
    """The stage table with stp's own units' kept bytes (stp.costmodel.decoder.kept), the
    memory costs and the bytes of one unit (one rank's share of layers). At one TP
    rank a microbatch whose backward is a full BW keeps more than one whose W is
    deferred; a stage's bytes are the two mixed in the proportion of its backwards."""
    width = DTYPE_BYTES[dtype]
    deferred, native = stp_kept(spec, width, False), stp_kept(spec, width, True)
    unit = deferred.layer_b * derived.layers_per_rank
    first, last = edge_costs(spec, hardware, pp)

    def table(kept: Kept) -> StageCosts:
        # Without full recomputation W's output gradients can outweigh what B freed when
        # W is deferred (a few percent); they are capped at M_B there (B frees). With it,
        # B rebuilds the unit and W keeps many times what F kept: B allocates the rest
        # (StageCost.mem_w > mem_b), else the estimate misses most of the peak.
        cap = (lambda m_w, m_b: m_w) if spec.recompute == "full" else min
        mem = MemCosts(m_b=kept.layer_b / deferred.layer_b, m_w=0.0)
        ends = (replace(first, mem_b=kept.first_b / unit,
                        mem_w=cap(kept.first_w, kept.first_b) / unit),
                replace(last, mem_b=kept.last_b / unit,
                        mem_w=cap(kept.last_w, kept.last_b) / unit))
        layered = LayeredCosts.from_rank_share(derived.costs, mem, pp, spec.layers,
                                               first=ends[0], last=ends[1])
        per_layer = cap(kept.layer_w, kept.layer_b) / deferred.layer_b * pp / spec.layers
        layered = replace(layered, layer=replace(layered.layer, mem_w=per_layer))
        return layered.table(counts)

    split, whole = table(deferred), table(native)
    full = [0] * sch.num_stages
    backwards = [0] * sch.num_stages
    for p in (p for acts in sch.actions for a in acts for p in passes_of(a)):
        if p.kind in (Kind.B, Kind.BW):
            backwards[p.stage] += 1
            full[p.stage] += p.kind is Kind.BW
    stages = tuple(replace(d, mem_b=(1 - x) * d.mem_b + x * n.mem_b,
                           mem_w=(1 - x) * d.mem_w + x * n.mem_w)
                   for d, n, x in zip(split.stages, whole.stages,
                                      (f / max(b, 1) for f, b in zip(full, backwards,
                                                                     strict=True)),
                                      strict=True))
    mem = MemCosts(m_b=1.0, m_w=min(1.0, deferred.layer_w / deferred.layer_b))
    return replace(split, stages=stages), mem, unit


def memory_of_run(spec: ModelSpec, res: SimResult, bytes_per_unit: float,
                  features: Features = Features(), dp: int = 1) -> MemoryEstimate:
    """Bytes per rank of a simulated run of `spec` (its per-stage table
    priced from `spec`; memory units of `bytes_per_unit` bytes, as
    `derive` gives them); the layout is read off the run."""
    sch = res.schedule
    counts = (res.stages.partition if res.stages is not None and res.stages.partition
              else even_partition(spec.layers, sch.num_stages))
    layout = Layout(pp=sch.num_ranks, tp=spec.tp, dp=dp, microbatches=sch.num_microbatches,
                    microbatch_size=spec.micro_batch, seq_len=spec.sequence, schedule=sch.name,
                    partition=tuple(counts))
    act_scale = bytes_per_unit * DTYPE_BYTES[features.dtype] / 2
    params = rank_parameters(spec, sch.num_stages, sch.stage_to_rank, tuple(counts))
    experts = rank_parameters(spec, sch.num_stages, sch.stage_to_rank, tuple(counts),
                              experts_only=True)
    each = tuple(range(sch.num_stages))
    stage_params = rank_parameters(spec, sch.num_stages, each, tuple(counts))
    stage_experts = rank_parameters(spec, sch.num_stages, each, tuple(counts),
                                    experts_only=True)
    return _assemble(spec, res, act_scale, features, layout, (params, experts),
                     (stage_params, stage_experts))


def _assemble(spec: ModelSpec, res: SimResult, act_scale: float, features: Features,
              layout: Layout, by_rank: tuple[list[int], list[int]],
              by_stage: tuple[list[int], list[int]]) -> MemoryEstimate:
    """Bytes per rank from the parameters (and the experts among them) of each
    pipeline rank and of each global stage, and the simulated run's peaks in units of
    `act_scale` bytes; `spec` sizes the buffers (its sequence, micro_batch, hidden,
    tp, sequence_parallel)."""
    sch, dp = res.schedule, layout.dp
    (params, experts), (stage_params, stage_experts) = by_rank, by_stage
    ep = min(spec.ep if isinstance(spec, MoESpec) else 1, dp)
    ranks = []
    for r, n in enumerate(params):
        rank = _rank(r, n, res.ranks[r].peak_activation * act_scale, spec, sch.chunks, layout,
                     features, experts[r])
        copies = reduction_copies(
            sch, r, stage_params, stage_experts, dp=layout.dp, ep=ep,
            width=4 if features.sixteen_bit else DTYPE_BYTES[features.dtype],
            segments=features.shard_optimizer and (features.overlap_grad_sync
                                                    or features.sixteen_bit),
            in_place=features.sixteen_bit)
        added = copies_over_peak(res, r, copies, act_scale, features.overlap_grad_sync)
        ranks.append(replace(rank, buffers=rank.buffers + added, copies=added))
    notes = []
    splits = any(p.kind is Kind.W for acts in sch.actions for a in acts for p in passes_of(a))
    if spec.recompute == "full" and splits and features.runtime != "stp":
        notes.append(f"{sch.name} defers W: full recomputation's inputs kept for a "
                     "deferred W are not counted (stp.costmodel.decoder.spec)")
    return MemoryEstimate(tuple(ranks), layout, features, tuple(notes), res.makespan)


def _rank(rank: int, params: int, activations: float, spec: ModelSpec, chunks: int,
          layout: Layout, f: Features, experts: int = 0) -> RankMemory:
    width = DTYPE_BYTES[f.dtype]
    ep = spec.ep if isinstance(spec, MoESpec) else 1
    shard = layout.dp if f.shard_optimizer else 1
    # the sharded optimizer splits dense states over dp, expert states over the dp / ep
    # ranks that hold the same experts (the expert-data-parallel group): counted here as
    # `states` parameters split dp ways
    states = params + experts * (min(ep, layout.dp) - 1) if f.shard_optimizer else params
    grad_bytes = 4 if f.sixteen_bit else width
    masters = 4 * states / shard if f.sixteen_bit else 0.0
    moments = 2 * max(4, width) * states / shard
    values = spec.sequence * spec.micro_batch * spec.hidden * width  # one s b h tensor
    p2p = 2 * chunks * values / (spec.tp if spec.sequence_parallel else 1)
    gathered = 2 * values if spec.sequence_parallel and spec.tp > 1 else 0.0
    grad_shard = 4 * states / shard if f.shard_optimizer and layout.dp > 1 else 0.0
    # two passes' all-to-all in flight, a send and a receive buffer of s b k h each
    a2a = 2 * 2 * values * spec.top_k if isinstance(spec, MoESpec) and ep > 1 else 0.0
    return RankMemory(rank, params, float(params * width), float(params * grad_bytes),
                      float(masters), float(moments), float(activations),
                      float(p2p + gathered + grad_shard + a2a))


def format_bytes(n: float) -> str:
    """`12.3 GiB` style, binary units."""
    if n < 1024:
        return f"{n:.0f} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exp]}"
