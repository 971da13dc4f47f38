"""Does the multimodal model look at the image? Trains `--arch mllm` (the stp
Trainer, one process) for 80 steps on the seeded coloured-shape captions
(stp.train.images), and again with every image blanked (a caption-only
baseline), from the same initial weights on the same batches. Prints both
curves every 10 steps and the means of the last 10 steps, of two losses: the
total (every caption byte) and the image-dependent one (only the bytes the
image decides: the first byte of each position, colour and shape word and the
separator after a shape; stp.train.images.image_choices). Past a word's first
byte the text predicts the rest, so the total moves less than the
image-dependent loss; the model that sees the images must end lower on both.
The image-dependent loss of a step is taken by a forward pass on the step's
batch just before the update, as the step's own loss is. Writes the table to
benchmarks/results/mllm_learning.md.

    python3 benchmarks/bench_mllm_learning.py [--steps 80] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from stp.models import IGNORE_INDEX
from stp.train.config import ModelShape, TrainJob, VisionShape
from stp.train.job import model_config
from stp.train.lr import adamw
from stp.train.mllm_job import mllm_batches
from stp.train.trainer import Trainer

JOB = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=64, heads=4, seq_len=64),
               vision=VisionShape(image_size=32, patch=4, vision_layers=2), pp=1,
               microbatches=1, microbatch_size=16, lr=3e-3, seed=0)
OUT = Path(__file__).parent / "results" / "mllm_learning.md"


@dataclasses.dataclass
class Curve:
    total: list[float]
    """Mean loss over every caption byte, each step."""
    image: dict[int, float]
    """Mean loss over the image-dependent bytes, at the steps measured."""


def curve(steps: int, blank: bool, measured: set[int]) -> Curve:
    cfg = model_config(JOB)
    torch.manual_seed(0)
    trainer = Trainer(cfg, adamw(JOB.lr), "1f1b", pp=1, microbatches=1)
    batches = mllm_batches(JOB, cfg, blank=blank)
    out = Curve([], {})
    for step in range(steps):
        inputs, targets, choices = batches.image_batch(step)
        if step in measured:
            chosen = torch.where(choices, targets, torch.full_like(targets, IGNORE_INDEX))
            out.image[step] = trainer.evaluate((inputs, chosen))
        out.total.append(trainer.step((inputs, targets)))
    return out


def table(steps: int, seen: Curve, blank: Curve, shown: list[int], tail: range) -> list[str]:
    """Markdown rows: both losses of both runs at the shown steps and the tail's mean."""
    rows = ["| step | total, with images | total, blanked | image-dependent, with images "
            "| image-dependent, blanked |", "|---:|---:|---:|---:|---:|"]
    for s in shown:
        rows.append(f"| {s} | {seen.total[s]:.4f} | {blank.total[s]:.4f} | "
                    f"{seen.image[s]:.4f} | {blank.image[s]:.4f} |")
    mean = [sum(v[s] for s in tail) / len(tail)
            for v in (seen.total, blank.total, seen.image, blank.image)]
    rows.append(f"| mean of steps {tail.start}-{tail.stop - 1} | {mean[0]:.4f} | {mean[1]:.4f} "
                f"| {mean[2]:.4f} | {mean[3]:.4f} |")
    rows.append("")
    rows.append(f"Blanked over with images, mean of the last {len(tail)} steps: total "
                f"{mean[1] / mean[0]:.3f}x, image-dependent {mean[3] / mean[2]:.3f}x.")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    steps = args.steps
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    tail = range(max(0, steps - 10), steps)
    shown = sorted({*range(0, steps, 10), steps - 1})
    measured = set(shown) | set(tail)
    start = time.perf_counter()
    seen, blank = curve(steps, False, measured), curve(steps, True, measured)
    rows = table(steps, seen, blank, shown, tail)
    head = [
        "# Multimodal model: does it use the image?", "",
        f"`python3 benchmarks/bench_mllm_learning.py --steps {steps}`: the stp Trainer, one "
        f"process, {JOB.microbatch_size} captions per step, AdamW lr {JOB.lr}; decoder "
        f"{dataclasses.asdict(JOB.model)}, encoder {dataclasses.asdict(JOB.vision)}. "
        "Losses in nats per caption byte; image-dependent: only the bytes the image decides "
        "(first byte of each position, colour and shape word, separator after a shape). "
        f"{time.perf_counter() - start:.0f} s on this machine.", ""]
    text = "\n".join(head + rows) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
