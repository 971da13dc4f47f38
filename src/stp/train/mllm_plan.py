"""`stp train --arch mllm --partition auto`: the vision blocks and decoder layers
of each global stage, from the multimodal cost model.

The job's MLLMConfig and shapes become an `MLLMSpec` (one image per sample,
the caption's `--seq-len` text tokens, `--microbatch-size` samples per
microbatch), costed on the same hardware preset as the decoder's auto
partition (stp.train.plan): only the ratio of one layer to another matters
for the choice. `mllm_layered_costs` prices a stage by where it starts (an
encoder block is far cheaper than a decoder layer at these widths, and the
merger rides with the last block), and `auto_partition` lets the simulator
judge. The counts come back encoder blocks first, as `--partition` takes them.

Two things the cost model assumes and stp's encoder does not do: Qwen2-VL's
patches span two video frames (stp's one image), and `tp` is taken as 1
(as for the decoder: a TP split scales every layer alike). Both move the
patch embedding's or every layer's cost by the same factor on every
partition, so the choice barely depends on them.
"""

from __future__ import annotations

from stp.costmodel import HARDWARE, MLLMSpec
from stp.costmodel.mllm_costs import derive_mllm, mllm_layered_costs
from stp.models.mllm_config import MLLMConfig
from stp.schedule import Schedule
from stp.search.partition import auto_partition
from stp.train.config import TrainJob

__all__ = ["HARDWARE_PRESET", "check_auto_fits", "mllm_auto_partition", "mllm_spec"]

HARDWARE_PRESET = "a100-80g"
"""The decoder's auto partition prices layers on the same preset."""


def mllm_spec(job: TrainJob, config: MLLMConfig) -> MLLMSpec:
    """The cost model's view of `config` trained with `job`'s batch shapes."""
    dec, vis = config.decoder, config.vision
    return MLLMSpec(
        layers=dec.num_layers, hidden=dec.num_heads * dec.head_dim, heads=dec.num_heads,
        kv_heads=dec.num_kv_heads, ffn=dec.ffn, vocab=dec.vocab_size,
        sequence=job.model.seq_len, vision_layers=vis.num_layers, vision_hidden=vis.hidden,
        vision_heads=vis.num_heads, vision_mlp=vis.mlp, patch=vis.patch_size, merge=vis.merge,
        images=1, resolution=vis.image_size, micro_batch=job.microbatch_size, tp=1,
        name="stp-mllm",
    )


def check_auto_fits(config: MLLMConfig, stages: int) -> None:
    """ValueError (one line) when the model has fewer layers than `stages`."""
    vis, dec = config.vision.num_layers, config.decoder.num_layers
    if vis + dec < stages:
        raise ValueError(f"--partition auto: {vis} vision + {dec} decoder layers cannot fill "
                         f"the schedule's {stages} stages (every stage needs a layer); give "
                         "more --vision-layers / --layers or fewer stages")


def mllm_auto_partition(job: TrainJob, config: MLLMConfig,
                        schedule: Schedule) -> tuple[int, ...]:
    """Layers of each global stage (vision blocks first, then decoder layers) with
    the shortest simulated step; ValueError (one line) when there are fewer layers
    than stages."""
    check_auto_fits(config, schedule.num_stages)
    spec = mllm_spec(job, config)
    hw = HARDWARE[HARDWARE_PRESET]
    # pp only sets the memory unit (one rank's share) of the tables, not a time, and
    # the search has no memory limit, so the choice does not depend on it
    d = derive_mllm(spec, hw, job.pp)
    layered = mllm_layered_costs(spec, hw, job.pp, d.costs, d.mem)
    return auto_partition(schedule, layered, spec.total_layers).counts
