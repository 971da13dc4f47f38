"""Does the multimodal model look at the image? Trains `--arch mllm` (the stp
Trainer, one process) for 80 steps on the seeded coloured-shape captions
(stp.train.images), and again with every image blanked (a caption-only
baseline). Prints both loss curves (every 10 steps, and the mean of the last
10): the model that sees the images must end clearly lower, since colours,
shapes and positions in the captions can only come from the pixels.

    python3 benchmarks/bench_mllm_learning.py [--steps 80]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from stp.train.config import ModelShape, TrainJob, VisionShape
from stp.train.job import model_config
from stp.train.lr import adamw
from stp.train.mllm_job import mllm_batches
from stp.train.trainer import Trainer

JOB = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=64, heads=4, seq_len=64),
               vision=VisionShape(image_size=32, patch=4, vision_layers=2), pp=1,
               microbatches=1, microbatch_size=16, lr=3e-3, seed=0)


def curve(steps: int, blank: bool) -> list[float]:
    cfg = model_config(JOB)
    torch.manual_seed(0)
    trainer = Trainer(cfg, adamw(JOB.lr), "1f1b", pp=1, microbatches=1)
    batches = mllm_batches(JOB, cfg, blank=blank)
    return [trainer.step(batches.batch(step)) for step in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    steps = ap.parse_args().steps
    start = time.perf_counter()
    seen, blank = curve(steps, False), curve(steps, True)
    print(f"{'step':>5} {'with images':>12} {'images blanked':>15}")
    for s in [*range(0, steps, 10), steps - 1]:
        print(f"{s:>5} {seen[s]:>12.4f} {blank[s]:>15.4f}")
    tail = min(10, steps)
    a, b = sum(seen[-tail:]) / tail, sum(blank[-tail:]) / tail
    print(f"mean of the last {tail} steps: with images {a:.4f}, blanked {b:.4f} "
          f"(difference {b - a:.4f}); {time.perf_counter() - start:.0f} s, "
          f"model {dataclasses.asdict(JOB.vision)}")


if __name__ == "__main__":
    main()
