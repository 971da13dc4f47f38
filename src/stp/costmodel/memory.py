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

Each family prices its own spec (its row of stp.costmodel.families: the
decoder's and a mixture of experts' in stp.costmodel.decoder.memory). A
multimodal model (`stp.costmodel.mllm.spec.MLLMSpec`) is priced the same way
with its own parts (stp.costmodel.mllm.memory): the vision encoder,
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
from typing import Any

from stp.costmodel.configs import spec_from_config
from stp.costmodel.families import is_spec, pricing_of
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.memory_types import (
    CATEGORIES,
    DTYPE_BYTES,
    Features,
    Layout,
    MemoryEstimate,
    RankMemory,
)
from stp.schedule.ir import Schedule
from stp.sim.result import SimResult

__all__ = ["DTYPE_BYTES", "CATEGORIES", "Layout", "Features", "RankMemory", "MemoryEstimate",
           "estimate", "estimate_run", "format_bytes"]


def estimate(model: Any, hardware: HardwareSpec, layout: Layout,
             features: Features = Features(), schedule: Schedule | None = None
             ) -> MemoryEstimate:
    """Bytes per pipeline rank of a training step (module doc). See `estimate_run`."""
    return estimate_run(model, hardware, layout, features, schedule)[0]


def estimate_run(model: Any, hardware: HardwareSpec, layout: Layout,
                 features: Features = Features(), schedule: Schedule | None = None
                 ) -> tuple[MemoryEstimate, SimResult]:
    """`estimate`, and the simulated step it read the activations from (the planner,
    `stp.plan`, ranks by that step and explains it by its parts). Bytes per pipeline
    rank of a training step (module doc). `model` is a cost-model spec of any
    family or the config a run builds (`stp.costmodel.configs`); its tp, sequence,
    micro_batch, sequence_parallel and recompute are taken from `layout` and
    `features`. `schedule`: the one to simulate (a schedule file's); None generates
    `layout.schedule` for `layout.pp` and `microbatches`."""
    if not is_spec(model):
        model = spec_from_config(model, seq_len=layout.seq_len)
    return pricing_of(model).estimate(model, hardware, layout, features, schedule)


def format_bytes(n: float) -> str:
    """`12.3 GiB` style, binary units."""
    if n < 1024:
        return f"{n:.0f} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exp]}"
