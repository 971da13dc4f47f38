"""`stp train --arch mllm`: the multimodal model, its checks and its data.

The decoder's shape comes from the usual flags (stp.train.job.model_config);
the encoder's from `TrainJob.vision`. `--seq-len` is the caption's tokens:
the decoder sees image tokens + seq-len positions. The data are seeded
coloured-shape images (stp.train.images.ShapeImages), or `--images DIR`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stp.models import ModelConfig
from stp.models.mllm_config import MLLMConfig, VisionConfig
from stp.models.mllm_stage import check_mllm
from stp.schedule import Schedule
from stp.train.config import TrainJob
from stp.train.images import CaptionBatches, ImageFolder, ShapeImages

__all__ = ["mllm_config", "check_mllm_job", "mllm_batches"]


def mllm_config(job: TrainJob, decoder: ModelConfig) -> MLLMConfig:
    """The encoder of `job.vision` in front of `decoder` (its max_seq_len widened to
    hold the image tokens); ValueError naming the flag for a shape that does not fit."""
    v = job.vision
    try:
        vision = VisionConfig(image_size=v.image_size, patch_size=v.patch, merge=v.merge,
                              hidden=v.vision_hidden, num_layers=v.vision_layers,
                              num_heads=v.vision_heads)
        seq = vision.image_tokens + job.model.seq_len
        return MLLMConfig(vision, dataclasses.replace(decoder, max_seq_len=seq))
    except ValueError as e:
        raise ValueError(f"--arch mllm: {e} (see --image-size, --patch, --merge, "
                         "--vision-hidden, --vision-heads)") from None


def check_mllm_job(job: TrainJob, config: MLLMConfig, schedule: Schedule) -> None:
    """ValueError for settings `--arch mllm` does not take, or a model that does not fit."""
    for flag, value in (("--init-from", job.init_from), ("--tokenizer", job.tokenizer),
                        ("--data", job.data), ("--eval-data", job.eval_data),
                        ("--save-hf", job.save_hf), ("--emulate-compute", job.emulate)):
        if value is not None:
            raise ValueError(f"--arch mllm trains on images (--images DIR or generated shapes); "
                             f"drop {flag}")
    if job.partition == "auto":
        raise ValueError("--arch mllm: give --partition as layer counts (vision blocks first, "
                         "then decoder layers), not auto")
    check_mllm(config, job.tp, schedule.num_stages)
    if job.images is not None:
        if not Path(job.images).is_dir():
            raise ValueError(f"--images {job.images!r} is not a directory")
        ImageFolder(Path(job.images), job.vision.image_size)  # reads captions.txt


def mllm_batches(job: TrainJob, config: MLLMConfig, *, blank: bool = False) -> CaptionBatches:
    """The run's global batches: batch `step` is a function of (seed, step)."""
    size = config.vision.image_size
    source = (ShapeImages(size, job.seed) if job.images is None
              else ImageFolder(Path(job.images), size))
    return CaptionBatches(source, config, job.model.seq_len, job.global_batch, job.seed, blank)
