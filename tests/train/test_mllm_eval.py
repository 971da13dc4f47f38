"""`stp train --arch mllm --eval-every N`: the held-out loss on steps N, 2N, ..., the
same floats on pp1 and pp2 (float64) and the single-process reference's; the
held-out batches are fixed and none is a training batch; `--eval-images DIR`
evaluates on that directory's images; bad combinations exit 2 in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stp.cli.main import main
from stp.models.mllm.reference import build_mllm_reference
from stp.train.families.mllm import mllm_batches
from stp.train.run.config import ModelShape, TrainJob, VisionShape
from stp.train.run.job import check, model_config
from stp.train.run.loop import EVAL_BATCHES, _eval_batches
from stp.train.run.resolve import resolve
from stp.train.step.lr import adamw

# the smallest shapes of tests/train/test_mllm_train.py: the runs are start-up bound
SHAPE = ["--arch", "mllm", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "12",
         "--vision-layers", "2", "--image-size", "8", "--patch", "2", "--vision-hidden", "8",
         "--microbatch-size", "1", "-m", "4", "--dtype", "float64", "--timeout", "60"]
JOB = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=12),
               vision=VisionShape(image_size=8, patch=2, vision_layers=2, vision_hidden=8),
               microbatches=4, microbatch_size=1, steps=4, dtype="float64", eval_every=2)
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]


def _folder(path: Path, colours: list[tuple[int, int, int]], word: str) -> Path:
    """A --images directory: one solid 8 x 8 PNG per colour, captioned `word` + index."""
    path.mkdir()
    lines = []
    for i, c in enumerate(colours):
        Image.new("RGB", (8, 8), c).save(path / f"{i}.png")
        lines.append(f"{i}.png\t{word} {i}")
    (path / "captions.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _stp_rows(argv: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *SHAPE, "--json", *argv,
           "--out", str(out)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert got.returncode == 0, got.stderr[-3000:]
    return [r for r in map(json.loads, got.stdout.splitlines()) if "loss" in r]


def _reference_eval_losses(job: TrainJob) -> list[float]:
    """The one-process model's mean held-out loss after steps N, 2N, ..."""
    cfg = model_config(job)
    model = build_mllm_reference(cfg, torch.float64)
    opt = adamw(resolve(job).job.lr)(list(model.parameters()))  # the default of its width
    train, evals, out = mllm_batches(job, cfg), _eval_batches(resolve(job)), []
    for step in range(job.steps):
        opt.zero_grad()
        model.loss(*train.batch(step)).backward()
        opt.step()
        if (step + 1) % job.eval_every == 0:
            with torch.no_grad():
                out.append(sum(float(model.loss(*b)) for b in evals) / len(evals))
    return out


def test_eval_loss_on_every_nth_step_equal_on_pp1_pp2_and_reference(tmp_path):
    argv = ["--steps", "4", "--eval-every", "2", "--schedule", "1f1b"]
    pp1 = _stp_rows([*argv, "--pp", "1"], tmp_path / "pp1")
    pp2 = _stp_rows([*argv, "--pp", "2"], tmp_path / "pp2")
    for rows in (pp1, pp2):
        assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4], rows
    got1 = [r["eval_loss"] for r in pp1 if "eval_loss" in r]
    got2 = [r["eval_loss"] for r in pp2 if "eval_loss" in r]
    ref = _reference_eval_losses(JOB)
    for got in (got1, got2):
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) <= 1e-9, (got, ref)
    assert ref[1] != ref[0]  # the model changed between the evaluations


def test_held_out_batches_are_fixed_and_none_is_a_training_batch():
    evals = _eval_batches(resolve(JOB))
    assert len(evals) == EVAL_BATCHES
    again = _eval_batches(resolve(JOB))  # every evaluation sees the same batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(evals, again, strict=True))
    train = mllm_batches(JOB, model_config(JOB))
    for step in range(JOB.steps):
        inputs, _ = train.batch(step)
        for held, _ in evals:
            assert not torch.equal(inputs, held), step
    # nor are they the training stream's samples taken in the same order: the stream
    # differs, not only which of its samples are picked
    same_order = dataclasses.replace(train, in_order=True)
    for step, (held, _) in enumerate(evals):
        inputs, _ = same_order.batch(step)
        assert not any(torch.equal(a, b) for a, b in zip(held, inputs, strict=True)), step
    rows = {tuple(r.tolist()) for held, _ in evals for r in held}
    assert len(rows) > 1  # not one image over and over


def test_eval_images_are_the_batches_and_each_image_is_seen(tmp_path):
    train = _folder(tmp_path / "train", [(250, 250, 250)], "train")
    held = _folder(tmp_path / "held", COLOURS, "held")
    job = dataclasses.replace(JOB, images=str(train), eval_images=str(held), out=str(tmp_path))
    check(job)
    pixels = 8 * 8 * 3
    seen = set()
    for inputs, _ in _eval_batches(resolve(job)):
        for row in inputs:
            rgb = tuple(row[:3].tolist())
            assert rgb in COLOURS  # the held-out images, never the training one
            assert torch.equal(row[:pixels].view(-1, 3), torch.tensor([rgb] * 64))
            caption = bytes(row[pixels:].tolist()).rstrip(b"\0")
            assert caption == b"\nheld %d\n" % COLOURS.index(rgb)
            seen.add(rgb)
    assert seen == set(COLOURS)


def _one_line_exit_2(argv: list[str], capsys) -> str:
    code = main(["train", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_eval_images_run_reports_eval_loss(tmp_path):
    train = _folder(tmp_path / "train", COLOURS[:2], "train")
    held = _folder(tmp_path / "held", COLOURS[2:], "held")
    rows = _stp_rows(["--pp", "1", "--steps", "2", "--eval-every", "1", "--images", str(train),
                      "--eval-images", str(held)], tmp_path / "out")
    losses = [r.get("eval_loss") for r in rows]
    assert len(losses) == 2 and all(np.isfinite(x) for x in losses), rows


@pytest.mark.parametrize("argv, needle", [
    (["--eval-every", "2", "--images", "{train}"], "--eval-every with --images needs "
                                                   "--eval-images DIR"),
    (["--eval-images", "{held}"], "is read by --eval-every N"),
    (["--eval-every", "2", "--eval-images", "{tmp}/missing"], "is not a directory"),
    (["--eval-every", "2", "--eval-images", "{empty}"], "needs a captions.txt"),
    (["--eval-every", "2", "--eval-images", "{none}"], "lists no images"),
    (["--eval-every", "2", "--eval-images", "{bad}"], "is not a readable PNG/JPEG image"),
], ids=["images-without-eval-images", "without-eval-every", "missing", "no-captions",
        "no-images", "not-an-image"])
def test_bad_eval_images_exit_2_in_one_line(argv, needle, tmp_path, capsys):
    dirs = {"train": _folder(tmp_path / "train", COLOURS[:1], "t"),
            "held": _folder(tmp_path / "held", COLOURS[1:], "h"),
            "tmp": tmp_path, "empty": tmp_path / "empty", "none": tmp_path / "none",
            "bad": tmp_path / "bad"}
    dirs["empty"].mkdir()
    dirs["none"].mkdir()
    (dirs["none"] / "captions.txt").write_text("# nothing listed\n", encoding="utf-8")
    dirs["bad"].mkdir()
    (dirs["bad"] / "x.png").write_text("not a png", encoding="utf-8")
    (dirs["bad"] / "captions.txt").write_text("x.png\ta caption\n", encoding="utf-8")
    argv = [a.format(**dirs) for a in argv]
    err = _one_line_exit_2([*SHAPE, "--steps", "2", *argv, "--out", str(tmp_path / "o")],
                           capsys)
    assert needle in err, err


def test_eval_images_without_arch_mllm_exits_2(tmp_path, capsys):
    held = _folder(tmp_path / "held", COLOURS, "h")
    err = _one_line_exit_2(["--steps", "2", "--eval-every", "2", "--eval-images", str(held),
                            "--out", str(tmp_path / "o")], capsys)
    assert "--eval-images" in err and "--arch mllm" in err, err


def test_images_without_arch_mllm_exits_2(tmp_path, capsys):
    folder = _folder(tmp_path / "imgs", COLOURS, "t")
    err = _one_line_exit_2(["--steps", "2", "--images", str(folder),
                            "--out", str(tmp_path / "o")], capsys)
    assert "--images" in err and "--arch mllm" in err, err


def test_eval_data_with_arch_mllm_points_to_held_out_images(tmp_path, capsys):
    text = tmp_path / "held.txt"
    text.write_text("held-out text " * 50, encoding="utf-8")
    err = _one_line_exit_2([*SHAPE, "--steps", "2", "--eval-every", "2", "--eval-data", str(text),
                            "--out", str(tmp_path / "o")], capsys)
    assert "--eval-data" in err and "--eval-images" in err, err
