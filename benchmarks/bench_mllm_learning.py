"""Does the multimodal model look at the image? Trains `--arch mllm` (the stp
Trainer, one process) for 80 steps on the seeded coloured-shape captions
(stp.train.data.images), and again with every image blanked (a caption-only
baseline), from the same initial weights on the same batches. Prints both
curves every 10 steps and the means of the last 10 steps, of two losses: the
total (every caption byte) and the image-dependent one (only the bytes the
image decides: the first byte of each position, colour and shape word and the
separator after a shape; stp.train.data.images.image_choices). Past a word's first
byte the text predicts the rest, so the total moves less than the
image-dependent loss; the model that sees the images must end lower on both.
The image-dependent loss of a step is taken by a forward pass on the step's
batch just before the update, as the step's own loss is. Writes the table to
benchmarks/results/mllm_learning.md.

`--seeds 0,1,2`: the same for each seed, one after another (the seed draws the
initial weights, the images and the captions). Seed 0's per-step table is the
file's first; every run also writes an "Across seeds" table of the last-10-step
means per seed, merging its rows with the file's earlier ones (seed 0's taken
from its per-step table), so seeds run separately end up in one table.

    python3 benchmarks/bench_mllm_learning.py [--steps 80] [--seeds 0] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import torch

from stp.files import write_text_atomic
from stp.models import IGNORE_INDEX
from stp.train.families.mllm import mllm_batches
from stp.train.run.config import ModelShape, TrainJob, VisionShape
from stp.train.run.job import model_config
from stp.train.step.lr import adamw
from stp.train.step.trainer import Trainer

JOB = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=64, heads=4, seq_len=64),
               vision=VisionShape(image_size=32, patch=4, vision_layers=2), pp=1,
               microbatches=1, microbatch_size=32, lr=3e-3, seed=0)
OUT = Path(__file__).parent / "results" / "mllm_learning.md"


@dataclasses.dataclass
class Curve:
    total: list[float]
    """Mean loss over every caption byte, each step."""
    image: dict[int, float]
    """Mean loss over the image-dependent bytes, at the steps measured."""


def curve(steps: int, blank: bool, measured: set[int], seed: int = 0) -> Curve:
    job = dataclasses.replace(JOB, seed=seed)  # the weights' and the images' seed
    cfg = model_config(job)
    torch.manual_seed(seed)
    trainer = Trainer(cfg, adamw(job.lr), "1f1b", pp=1, microbatches=1)
    batches = mllm_batches(job, cfg, blank=blank)
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


SECTION = "## Across seeds"
MEAN_ROW = re.compile(r"^\| mean of steps \d+-(\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) "
                      r"\| ([\d.]+) \|$", re.M)
SEED_ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+x \| "
                      r"([\d.]+) \| ([\d.]+) \| [\d.]+x \| \w+ \|$", re.M)


def tail_means(seen: Curve, blank: Curve, tail: range) -> tuple[float, ...]:
    """(total with images, total blanked, image-dependent with, blanked) over `tail`."""
    return tuple(sum(v[s] for s in tail) / len(tail)
                 for v in (seen.total, blank.total, seen.image, blank.image))


def known_rows(text: str) -> dict[tuple[int, int], tuple[float, ...]]:
    """{(seed, steps): the four tail means} already in a results file: seed 0's
    from its per-step table, the others from the Across seeds table."""
    rows = {}
    head, _, section = text.partition(SECTION)
    for m in MEAN_ROW.finditer(head):
        rows[(0, int(m[1]) + 1)] = tuple(float(m[i]) for i in range(2, 6))
    for m in SEED_ROW.finditer(section):
        rows[(int(m[1]), int(m[2]))] = tuple(float(m[i]) for i in range(3, 7))
    return rows


def seeds_table(rows: dict[tuple[int, int], tuple[float, ...]], seconds: dict[int, float],
                steps: int) -> list[str]:
    """The Across seeds section: one row per (seed, steps), the two ratios, and
    whether blanking raised both losses."""
    out = [SECTION, "",
           f"`python3 benchmarks/bench_mllm_learning.py --steps {steps} --seeds ...`: the same "
           "model and optimizer; the seed draws the initial weights, the images and the "
           "captions. Means of the last 10 steps; ratio: blanked over with images. A seed "
           "not rerun keeps its earlier row (seed 0's is read from the table above: its "
           "ratios are of the rounded means)."
           + (" Both runs of a seed took " + ", ".join(
               f"{v:.0f} s (seed {k})" for k, v in sorted(seconds.items()))
              + " on this machine." if seconds else ""), "",
           "| seed | steps | total, with images | total, blanked | ratio "
           "| image-dependent, with images | image-dependent, blanked | ratio "
           "| blanked higher on both |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for (seed, n), (t, tb, i, ib) in sorted(rows.items()):
        higher = "yes" if tb > t and ib > i else "no"
        out.append(f"| {seed} | {n} | {t:.4f} | {tb:.4f} | {tb / t:.3f}x | {i:.4f} | "
                   f"{ib:.4f} | {ib / i:.3f}x | {higher} |")
    return out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        refuse(f"--seeds {text!r}: give distinct integers >= 0 separated by commas, e.g. 0,1,2")
    return seeds


def refuse(message: str) -> None:
    """Bad input: one line on stderr, exit status 2."""
    print(f"bench_mllm_learning: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, run one after another")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    steps, seeds = args.steps, parse_seeds(args.seeds)
    if steps < 1:
        refuse(f"--steps {steps}: give an integer >= 1")
    tail = range(max(0, steps - 10), steps)
    shown = sorted({*range(0, steps, 10), steps - 1})
    measured = set(shown) | set(tail)
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    head, rows, seconds = old.partition(SECTION)[0].rstrip("\n").split("\n"), {}, {}
    rows.update(known_rows(old))
    for seed in seeds:
        start = time.perf_counter()
        seen, blank = (curve(steps, False, measured, seed), curve(steps, True, measured, seed))
        seconds[seed] = time.perf_counter() - start
        per_step = table(steps, seen, blank, shown, tail)
        print(f"seed {seed}\n" + "\n".join(per_step) + "\n", flush=True)
        rows[(seed, steps)] = tail_means(seen, blank, tail)
        if seed == 0:
            head = intro(steps, seconds[seed]) + per_step
    text = "\n".join(head + [""] + seeds_table(rows, seconds, steps)) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)


def intro(steps: int, seconds: float) -> list[str]:
    return [
        "# Multimodal model: does it use the image?", "",
        f"`python3 benchmarks/bench_mllm_learning.py --steps {steps}`: the stp Trainer, one "
        f"process, {JOB.microbatch_size} captions per step, AdamW lr {JOB.lr}; decoder "
        f"{dataclasses.asdict(JOB.model)}, encoder {dataclasses.asdict(JOB.vision)}. "
        "Losses in nats per caption byte; image-dependent: only the bytes the image decides "
        "(first byte of each position, colour and shape word, separator after a shape). "
        f"{seconds:.0f} s on this machine.", ""]


if __name__ == "__main__":
    main()
