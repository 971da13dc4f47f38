"""A decoder's costs for the simulator: one rank's uniform share, and per-stage
costs with the embedding on the first stage and the output layer and loss on
the last.

One rank's share (`derive_decoder`): what one rank does for one microbatch
(its share: `L = layers / pp` transformer layers, all of its chunks together;
`stp.sim.costs`):

    f, b, w   L x (F, B, W FLOPs of a layer, `stp.costmodel.decoder.spec`) / achieved FLOP/s
    ar        L x 2 all-reduces of the layer output (s b h 16-bit values) in one
              F pass (Megatron-LM TP: after attention and after the MLP; B has the
              same two on the input gradients; Shoeybi et al. 2019, section 3)
    ag, rs    with sequence parallelism, instead of `ar`: L x 2 all-gathers and
              L x 2 reduce-scatters of the same s b h values (ring: each moves
              (t-1)/t of the bytes, half an all-reduce's traffic)
    a2a       a mixture of experts with ep > 1: L x 2 all-to-alls per MoE layer
              (dispatch, combine; `stp.costmodel.moe` for bytes and links)
    comm      one send of the stage output, s b h 16-bit values (1/t of it per
              TP rank with sequence parallelism, Korthikanti et al. 2023)
    mem       M_B = 1 unit = L x M_B bytes of a layer; M_W as a fraction of it

Times are in milliseconds. The embedding and output layer (vocabulary) sit on
the first and last stage only, so they are not in these uniform costs (the
output layer's forward is reported as `lm_head_ms`); `edge_costs` adds them
to the first and last stage of a per-stage cost table, which is what
`--model` simulates, and `--partition auto` balances them by giving those
stages fewer layers, as the Zero Bubble and STP papers do.

The offload ratio of "PipeOffload" (arXiv 2503.01328), `k = T_offload /
T_compute`, is `M_B bytes / host bandwidth` over `f + b + w`: k <= 1 means
every activation can go to host memory and back within its own compute.

Per-stage costs (`edge_costs`, `decoder_layered_costs`): the embedding on
the first stage, the output layer and the loss on the last, every layer on
the stage that holds it. What the first and last stages add to their layers, one microbatch, one TP
rank (`s` sequence, `b` microbatch size, `h` hidden, `V` vocabulary, `t`
TP size; FLOPs count matmuls, 2 per multiply-add, as `stp.costmodel.decoder.spec`):

    embedding   F: a row lookup, no matmul; the vocab-parallel lookup ends in
                   one all-reduce of the s b h output (Megatron-LM, Shoeybi
                   et al., arXiv 1909.08053, section 3: each rank holds V/t
                   rows and contributes zeros for the others). B: nothing to
                   reduce (no input gradient). W: a scatter-add, no matmul.
                   Kept: the token ids (8 s b bytes).
    output      F = B = W = 2 s b h V / t: the head matmul, its input
    layer          gradient and its weight gradient. The vocab-parallel
    and loss       cross-entropy reduces the row max, the sum of exponentials
                   and the target logit (three all-reduces of s b fp32
                   values) in F; B all-reduces the head's input gradient
                   (s b h). Kept until B: the norm's input and output
                   (4 s b h bytes) and the fp32 softmax (4 s b V / t); until
                   W: the head's input and the logits' gradient
                   (2 s b h + 2 s b V / t).

Times are milliseconds and memory is in units of one rank's share of the
layers' activations (`derive_decoder`), the units every other figure
of the simulator uses, so the output layer counts against the same memory
limit as the layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stp.costmodel.decoder.spec import ModelSpec, layer_activation_bytes, layer_flops
from stp.costmodel.hardware import (
    HardwareSpec,
    allgather_time,
    allreduce_time,
    p2p_time,
    reduce_scatter_time,
)
from stp.schedule.memory import MemCosts
from stp.sim.costs import Costs
from stp.sim.layered import LayeredCosts
from stp.sim.stages import StageCost

__all__ = ["Derived", "decoder_layered_costs", "decoder_model_flops", "derive_decoder",
           "edge_costs", "head_flops"]


@dataclass(frozen=True)
class Derived:
    """The simulator's inputs for one (model, hardware, pp), and how they came about."""

    costs: Costs
    """Times of one microbatch through one rank's share, milliseconds."""
    mem: MemCosts
    """M_B = 1 (the unit of every memory figure) and M_W / M_B."""
    bytes_per_unit: float
    """Bytes of one M_B unit on one GPU: converts memory figures to bytes."""
    layers_per_rank: float
    flops_per_rank: tuple[float, float, float]
    """F, B, W FLOPs of one microbatch through one rank's share (one TP rank)."""
    lm_head_ms: float
    """Output layer forward time (last stage only; not in `costs`, in the
    per-stage table of `stp.costmodel.stages`)."""
    offload_ratio: float
    """PipeOffload's k = offload time of M_B / compute time f + b + w."""

    def to_json(self) -> dict[str, object]:
        c = self.costs
        return {
            "costs_ms": {"f": c.f, "b": c.b, "w": c.w, "ar": c.ar, "comm": c.comm,
                         "ag": c.ag, "rs": c.rs, "a2a": c.a2a},
            "mem": {"b": self.mem.m_b, "w": self.mem.m_w},
            "bytes_per_unit": self.bytes_per_unit,
            "layers_per_rank": self.layers_per_rank,
            "flops_per_rank": list(self.flops_per_rank),
            "lm_head_ms": self.lm_head_ms,
            "offload_ratio": self.offload_ratio,
        }


def derive_decoder(model: ModelSpec, hardware: HardwareSpec, pp: int) -> Derived:
    """Per-rank costs of the decoder `model` cut into `pp` pipeline ranks on `hardware`."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline size pp={pp!r} must be an integer >= 1")
    if pp > model.layers:
        raise ValueError(
            f"pp={pp} exceeds the model's {model.layers} layers; at most one rank per layer"
        )
    per_rank = model.layers / pp
    f_fl, b_fl, w_fl = (x * per_rank for x in layer_flops(model))
    ms = 1e3 / hardware.achieved_flops
    s, b, h, t = model.sequence, model.micro_batch, model.hidden, model.tp
    layer_out = 2.0 * s * b * h  # bytes of one 16-bit layer output
    link = (t, hardware.tp_bandwidth, hardware.tp_latency)
    if model.sequence_parallel:
        # Korthikanti et al. (arXiv 2205.05198) section 4.2.2: each all-reduce
        # becomes a reduce-scatter and an all-gather of the same s b h values.
        ar, gather = 0.0, 2 * per_rank * allgather_time(layer_out, *link)
        scatter = 2 * per_rank * reduce_scatter_time(layer_out, *link)
    else:
        ar, gather, scatter = 2 * per_rank * allreduce_time(layer_out, *link), 0.0, 0.0
    sent = layer_out / t if model.sequence_parallel else layer_out
    comm = p2p_time(sent, hardware.pp_bandwidth, hardware.pp_latency)
    m_b, m_w = layer_activation_bytes(model)
    unit = m_b * per_rank
    a2a = per_rank * model.layer_a2a_time(hardware)  # expert parallelism (costmodel.moe)
    costs = Costs(f=f_fl * ms, b=b_fl * ms, w=w_fl * ms, ar=ar * 1e3, comm=comm * 1e3,
                  ag=gather * 1e3, rs=scatter * 1e3, a2a=a2a * 1e3)
    lm_head = 2.0 * s * b * h * model.vocab / t * ms
    compute = costs.f + costs.b + costs.w
    offload = (unit / hardware.host_bandwidth * 1e3) / compute
    return Derived(
        costs=costs,
        mem=MemCosts(m_b=1.0, m_w=m_w / m_b),
        bytes_per_unit=unit,
        layers_per_rank=per_rank,
        flops_per_rank=(f_fl, b_fl, w_fl),
        lm_head_ms=lm_head,
        offload_ratio=offload,
    )


def head_flops(model: ModelSpec) -> float:
    """FLOPs of the output layer's matmul in one pass (F, B and W each), one TP rank."""
    s, b, h = model.sequence, model.micro_batch, model.hidden
    return 2.0 * s * b * h * model.vocab / model.tp


def decoder_model_flops(model: ModelSpec) -> float:
    """Training FLOPs of one microbatch of the whole model: F, B and W of every layer
    and of the output layer, unsharded, no recomputation (the numerator of MFU:
    Chowdhery et al., PaLM, arXiv 2204.02311, appendix B, counts no recomputed work).
    Attention is counted full, `4 s^2 b h` a forward, as `layer_flops` counts it,
    not halved for the causal mask; the embedding lookup is no matmul."""
    spec = replace(model, tp=1, recompute="none", sequence_parallel=False)
    return model.layers * sum(layer_flops(spec)) + 3 * head_flops(spec)


def _allreduce_ms(num_bytes: float, model: ModelSpec, hw: HardwareSpec) -> float:
    return allreduce_time(num_bytes, model.tp, hw.tp_bandwidth, hw.tp_latency) * 1e3


def edge_costs(model: ModelSpec, hardware: HardwareSpec, pp: int) -> tuple[StageCost, StageCost]:
    """(what the first stage adds, what the last stage adds) to its layers:
    times in ms, memory in units of one rank's share of the layers (module doc)."""
    unit_bytes = derive_decoder(model, hardware, pp).bytes_per_unit
    s, b, h, t = model.sequence, model.micro_batch, model.hidden, model.tp
    ms = 1e3 / hardware.achieved_flops
    out = 2.0 * s * b * h  # one 16-bit activation of the residual stream
    ids = 8.0 * s * b / unit_bytes
    embed = StageCost(0.0, 0.0, 0.0, ar=_allreduce_ms(out, model, hardware), ar_b=0.0,
                      mem_b=ids, mem_w=ids)
    head = head_flops(model) * ms
    logits = s * b * model.vocab / t
    last = StageCost(
        head, head, head, ar=3 * _allreduce_ms(4.0 * s * b, model, hardware),
        ar_b=_allreduce_ms(out, model, hardware),
        mem_b=(2 * out + 4 * logits) / unit_bytes, mem_w=(out + 2 * logits) / unit_bytes,
    )
    return embed, last


def decoder_layered_costs(model: ModelSpec, hardware: HardwareSpec, pp: int, costs: Costs,
                          mem: MemCosts, layers: int = 1) -> LayeredCosts:
    """Per-layer costs from `costs`/`mem` (one rank's share, as `derive` gives
    them, possibly overridden) with the model's embedding and output layer on
    the first and last stage; a partition must sum to `model.layers`."""
    first, last = edge_costs(model, hardware, pp)
    return LayeredCosts.from_rank_share(costs, mem, pp, model.layers, layers=layers,
                                        first=first, last=last)
