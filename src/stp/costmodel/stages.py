"""Per-stage costs of a model: the embedding on the first stage, the output
layer and the loss on the last, every layer on the stage that holds it.

What the first and last stages add to their layers, one microbatch, one TP
rank (`s` sequence, `b` microbatch size, `h` hidden, `V` vocabulary, `t`
TP size; FLOPs count matmuls, 2 per multiply-add, as `stp.costmodel.model`):

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
layers' activations (`stp.costmodel.derive`), the units every other figure
of the simulator uses, so the output layer counts against the same memory
limit as the layers.
"""

from __future__ import annotations

from stp.costmodel.derive import derive
from stp.costmodel.hardware import HardwareSpec, allreduce_time
from stp.costmodel.mllm import MLLMSpec
from stp.costmodel.model import ModelSpec
from stp.schedule.memory import MemCosts
from stp.sim.costs import Costs
from stp.sim.layered import LayeredCosts
from stp.sim.stages import StageCost

__all__ = ["edge_costs", "head_flops", "layered_costs"]


def head_flops(model: ModelSpec) -> float:
    """FLOPs of the output layer's matmul in one pass (F, B and W each), one TP rank."""
    s, b, h = model.sequence, model.micro_batch, model.hidden
    return 2.0 * s * b * h * model.vocab / model.tp


def _allreduce_ms(num_bytes: float, model: ModelSpec, hw: HardwareSpec) -> float:
    return allreduce_time(num_bytes, model.tp, hw.tp_bandwidth, hw.tp_latency) * 1e3


def edge_costs(model: ModelSpec, hardware: HardwareSpec, pp: int) -> tuple[StageCost, StageCost]:
    """(what the first stage adds, what the last stage adds) to its layers:
    times in ms, memory in units of one rank's share of the layers (module doc)."""
    unit_bytes = derive(model, hardware, pp).bytes_per_unit
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


def layered_costs(model: ModelSpec | MLLMSpec, hardware: HardwareSpec, pp: int, costs: Costs,
                  mem: MemCosts, layers: int = 1) -> LayeredCosts:
    """Per-layer costs from `costs`/`mem` (one rank's share, as `derive` gives
    them, possibly overridden) with the model's embedding and output layer on
    the first and last stage; a partition must sum to `model.layers` (a
    multimodal model: encoder and decoder layers, `stp.costmodel.mllm_costs`)."""
    if isinstance(model, MLLMSpec):
        from stp.costmodel.mllm_costs import mllm_layered_costs

        return mllm_layered_costs(model, hardware, pp, costs, mem, layers)
    first, last = edge_costs(model, hardware, pp)
    return LayeredCosts.from_rank_share(costs, mem, pp, model.layers, layers=layers,
                                        first=first, last=last)
