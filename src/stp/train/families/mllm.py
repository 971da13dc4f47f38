"""`stp train --arch mllm`: the multimodal model, its checks and its data.

The decoder's shape comes from the usual flags (stp.train.families.decoder);
the encoder's from `TrainJob.vision`. `--seq-len` is the caption's tokens:
the decoder sees image tokens + seq-len positions. The data are seeded
coloured-shape images (stp.train.data.images.ShapeImages), or `--images DIR`.
`--partition` counts vision blocks first, then decoder layers; `auto` asks the
multimodal cost model (stp.costmodel.mllm.costs, through the family's cost
spec: stp.train.run.resolve). `--eval-every` evaluates on
held-out images: `--eval-images DIR`, or with generated shapes a held-out
stream of them (never the training images). `--sequence-parallel` splits the
decoder's whole sequence, image tokens + --seq-len, over the TP ranks (each
merge window of patches whole on one rank): it must divide by --tp, else the
run is refused in one line naming a --seq-len that fits (stp.models.mllm.rows).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from stp.models.mllm.family import MLLM
from stp.models.mllm.rows import check_mllm_sequence
from stp.schedule import Schedule
from stp.shapes import MLLMConfig, ModelConfig, VisionConfig
from stp.train.data.images import CaptionBatches, ImageFolder, ShapeImages, check_folder
from stp.train.families import RunInputs
from stp.train.families.decoder import decoder_config
from stp.train.run.config import TrainJob

__all__ = ["FAMILY", "MLLMJob", "check_auto_fits", "mllm_config", "mllm_batches",
           "mllm_eval_batches"]


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


def check_auto_fits(config: MLLMConfig, stages: int) -> None:
    """ValueError (one line) when the model has fewer layers than `stages`."""
    vis, dec = config.vision.num_layers, config.decoder.num_layers
    if vis + dec < stages:
        raise ValueError(f"--partition auto: {vis} vision + {dec} decoder layers cannot fill "
                         f"the schedule's {stages} stages (every stage needs a layer); give "
                         "more --vision-layers / --layers or fewer stages")


class MLLMJob:
    name = "mllm"
    model = MLLM

    def check_flags(self, job: TrainJob) -> None:
        """Settings `--arch mllm` does not take."""
        if job.model_name is not None:
            raise ValueError(f"--model {job.model_name} names a decoder (or a mixture of "
                             "experts); --arch mllm builds its own from the vision flags: "
                             "drop one of them")
        if job.save_hf is not None:
            raise ValueError("--arch mllm cannot --save-hf: stp's vision encoder and merger have "
                             "no Hugging Face layout to write; the checkpoints in --out keep the "
                             "full state (continue with --resume); drop --save-hf")
        if job.document_mask:
            raise ValueError("--arch mllm trains on one caption per image, with no documents "
                             "to mask: drop --document-mask")
        if job.eval_data is not None:
            raise ValueError(f"--arch mllm evaluates on held-out images, not text: drop "
                             f"--eval-data {job.eval_data!r} (held-out shapes are generated; "
                             "with --images give --eval-images DIR)")
        for flag, value in (("--init-from", job.init_from), ("--tokenizer", job.tokenizer),
                            ("--data", job.data), ("--emulate-compute", job.emulate)):
            if value is not None:
                raise ValueError(f"--arch mllm trains on images (--images DIR or generated "
                                 f"shapes); drop {flag}")

    def config(self, job: TrainJob, tokenizer: Any) -> MLLMConfig:
        return mllm_config(job, decoder_config(job, tokenizer))

    def check_run(self, job: TrainJob, config: MLLMConfig, schedule: Schedule) -> None:
        """A model that does not fit, or images that cannot be read."""
        if job.partition == "auto":  # before check_mllm: the message names --partition auto
            check_auto_fits(config, schedule.num_stages)
        self.model.check(config, job.tp, schedule.num_stages)
        if job.sequence_parallel and job.tp > 1:  # image tokens + caption split over TP
            check_mllm_sequence(config, job.model.seq_len, job.tp)
        if job.images is not None:
            check_folder(job.images, "--images")  # every image decoded before workers start
        _check_eval(job)

    def batches(self, run: RunInputs) -> CaptionBatches:
        return mllm_batches(run.job, run.config)

    def eval_batches(self, run: RunInputs) -> CaptionBatches | None:
        return mllm_eval_batches(run.job, run.config) if run.job.eval_every else None



def _check_eval(job: TrainJob) -> None:
    """--eval-every's held-out images: --eval-images, or generated ones."""
    if job.eval_images is not None and not job.eval_every:
        raise ValueError(f"--eval-images {job.eval_images!r} is read by --eval-every N; give "
                         "--eval-every N or drop --eval-images")
    if job.eval_every and job.images is not None and job.eval_images is None:
        raise ValueError("--eval-every with --images needs --eval-images DIR (held-out images "
                         "with their captions.txt): the training images are no held-out set")
    if job.eval_images is not None:
        check_folder(job.eval_images, "--eval-images")


def mllm_batches(job: TrainJob, config: MLLMConfig, *, blank: bool = False) -> CaptionBatches:
    """The run's global batches: batch `step` is a function of (seed, step)."""
    size = config.vision.image_size
    source = (ShapeImages(size, job.seed) if job.images is None
              else ImageFolder(Path(job.images), size))
    return CaptionBatches(source, config, job.model.seq_len, job.global_batch, job.seed, blank)


def mllm_eval_batches(job: TrainJob, config: MLLMConfig) -> CaptionBatches:
    """The held-out global batches of --eval-every, in order: --eval-images, or the
    generated shapes' held-out stream (stp.train.data.images)."""
    size = config.vision.image_size
    if job.eval_images is not None:
        source: ShapeImages | ImageFolder = ImageFolder(Path(job.eval_images), size)
    elif job.images is None:
        source = ShapeImages(size, job.seed, held_out=True)
    else:  # check_mllm_job refuses this: never evaluate on the training images
        raise ValueError("--eval-every with --images needs --eval-images DIR")
    return CaptionBatches(source, config, job.model.seq_len, job.global_batch, job.seed,
                          in_order=True)


FAMILY = MLLMJob()
