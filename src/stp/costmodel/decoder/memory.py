"""The decoder's bytes per pipeline rank (stp.costmodel.memory's module doc: the
terms, and whose activations): its parameters per rank, the simulated step under
its per-stage costs, and the assembled estimate. A mixture of experts is priced
here too, through the expert hooks of its spec (stp.costmodel.moe.spec: 1/ep of
the experts per rank, their optimizer states over the dp / ep ranks that hold
them, the all-to-all buffers); the multimodal model reuses the assembly
(stp.costmodel.mllm.memory).
"""

from __future__ import annotations

from dataclasses import replace

from stp.costmodel.decoder.costs import (
    Derived,
    decoder_layered_costs,
    derive_decoder,
    edge_costs,
)
from stp.costmodel.decoder.kept import Kept, stp_kept
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.dp_copies import copies_over_peak, reduction_copies
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.inlayer import in_layer_for
from stp.costmodel.memory_types import DTYPE_BYTES, Features, Layout, MemoryEstimate, RankMemory
from stp.schedule.ir import Kind, Schedule, passes_of
from stp.schedule.registry import generate
from stp.sim.costs import MemCosts, OffloadCosts
from stp.sim.engine import simulate
from stp.sim.layered import LayeredCosts, check_partition, even_partition
from stp.sim.offload import plan_offload
from stp.sim.result import SimResult
from stp.sim.stages import StageCosts
from stp.sim.table import program_peaks

__all__ = ["assemble", "estimate_decoder", "layout_schedule", "memory_of_run",
           "rank_parameters", "simulate_run", "states_bound"]


def _layer_parameters(spec: ModelSpec) -> float:
    """One TP rank's share of a layer: Q and O split by t; K and V split by t,
    or one kv head per rank when there are fewer kv heads than ranks (each is
    replicated); the MLP split by t (a mixture of experts' experts by ep too);
    the two norms replicated."""
    h, t, d = spec.hidden, spec.tp, spec.head_dim
    kv_per_rank = max(spec.kv_heads // t, 1) * d
    dense, _ = spec.mlp_parameters()
    router = spec.router_parameters()  # whole on every TP rank
    return (2 * h * h / t + 2 * h * kv_per_rank + (dense - router) / t + router
            + _layer_experts(spec) + 2 * h)


def _layer_experts(spec: ModelSpec) -> float:
    """One rank's share of a layer's expert weights: 1/ep of the experts, each split by t."""
    return spec.mlp_parameters()[1] / spec.tp / (spec.ep)


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


def estimate_decoder(model: ModelSpec, hardware: HardwareSpec, layout: Layout,
                     features: Features = Features(), schedule: Schedule | None = None
                     ) -> tuple[MemoryEstimate, SimResult]:
    """`stp.costmodel.memory.estimate_run` for a decoder (a mixture of experts too):
    the estimate and the simulated step it read the activations from."""
    spec, res, unit, ep_note = simulate_run(model, hardware, layout, features, schedule)
    # memory_of_run takes a 16-bit unit and scales it by the dtype
    est = memory_of_run(spec, res, unit * 2 / DTYPE_BYTES[features.dtype], features,
                        dp=layout.dp)
    if spec.has_experts:
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
                   offload_costs=oc, record_spans=False, stages=table,
                   braid=features.braid,
                   in_layer=in_layer_for(spec, hardware, features.tp_overlap_chunks))
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
    model, ep_note = model.at_layout_ep(layout.ep, layout.dp)
    spec = replace(model, tp=layout.tp, sequence=layout.seq_len,
                   micro_batch=layout.microbatch_size,
                   sequence_parallel=features.sequence_parallel, recompute=features.recompute)
    sch = layout_schedule(layout, schedule)
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
        layered = decoder_layered_costs(spec, hardware, layout.pp, derived.costs, derived.mem)
        mem, unit = derived.mem, derived.bytes_per_unit * DTYPE_BYTES[features.dtype] / 2
        table = layered.table(counts)
    return spec, sch, derived, table, mem, unit, ep_note


def layout_schedule(layout: Layout, schedule: Schedule | None) -> Schedule:
    """`schedule` (checked against the layout's pp and m), or the layout's generated."""
    opts = {} if layout.chunks is None else {"chunks": layout.chunks}
    sch = schedule or generate(layout.schedule, layout.pp, layout.microbatches, **opts)
    if (sch.num_ranks, sch.num_microbatches) != (layout.pp, layout.microbatches):
        raise ValueError(f"schedule {sch.name}: {sch.num_ranks} ranks x {sch.num_microbatches} "
                         f"microbatches, but the layout is pp={layout.pp} "
                         f"m={layout.microbatches}")
    return sch


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
    return assemble(spec, res, act_scale, features, layout, (params, experts),
                     (stage_params, stage_experts))


def assemble(spec: ModelSpec, res: SimResult, act_scale: float, features: Features,
              layout: Layout, by_rank: tuple[list[int], list[int]],
              by_stage: tuple[list[int], list[int]]) -> MemoryEstimate:
    """Bytes per rank from the parameters (and the experts among them) of each
    pipeline rank and of each global stage, and the simulated run's peaks in units of
    `act_scale` bytes; `spec` sizes the buffers (its sequence, micro_batch, hidden,
    tp, sequence_parallel)."""
    sch, dp = res.schedule, layout.dp
    (params, experts), (stage_params, stage_experts) = by_rank, by_stage
    ep = min(spec.ep, dp)
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
    ep = spec.ep
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
    a2a = 2 * 2 * values * spec.a2a_copies
    return RankMemory(rank, params, float(params * width), float(params * grad_bytes),
                      float(masters), float(moments), float(activations),
                      float(p2p + gathered + grad_shard + a2a))
