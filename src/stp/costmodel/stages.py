"""Per-stage costs of a model: `layered_costs` hands a spec to its own per-stage
cost function (stp.costmodel.families: the decoder's embedding and output
layer, stp.costmodel.decoder.costs; the multimodal model's encoder, merger and
decoder, stp.costmodel.mllm.costs).
"""

from __future__ import annotations

from stp.costmodel.decoder.costs import edge_costs, head_flops
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.families import costs_of
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.mllm.spec import MLLMSpec
from stp.schedule.memory import MemCosts
from stp.sim.costs import Costs
from stp.sim.layered import LayeredCosts

__all__ = ["edge_costs", "head_flops", "layered_costs"]


def layered_costs(model: ModelSpec | MLLMSpec, hardware: HardwareSpec, pp: int, costs: Costs,
                  mem: MemCosts, layers: int = 1) -> LayeredCosts:
    """Per-layer costs from `costs`/`mem` (one rank's share, as `derive` gives
    them, possibly overridden) with the model's embedding and output layer on
    the first and last stage; a partition must sum to the model's layers (a
    multimodal model: encoder blocks and decoder layers)."""
    return costs_of(model).layered(model, hardware, pp, costs, mem, layers)
