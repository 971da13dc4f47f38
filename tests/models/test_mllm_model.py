"""The multimodal stages (vision units + decoder units) agree with the independent
single-process reference: loss and every gradient, float64, for the model in
one stage and cut with the encoder spanning stages or sharing one."""

from __future__ import annotations

import pytest
import torch

from stp.models import IGNORE_INDEX, ModelConfig, StagePlacement
from stp.models.mllm.reference import build_mllm_reference
from stp.models.mllm.stage import build_mllm_stage
from stp.shapes.mllm import MLLMConfig, VisionConfig
from stp.train.data.images import CaptionBatches, ShapeImages, image_choices

DEC = ModelConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_seq_len=64, seed=1)
CFG = MLLMConfig(VisionConfig(image_size=16), DEC)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return CaptionBatches(ShapeImages(16, seed=5), CFG, text_len=20, batch_size=3).batch(0)


@pytest.mark.parametrize("partition", [None, (1, 1, 2), (3, 1)])
def test_stages_match_the_reference_in_loss_and_every_gradient(partition):
    inputs, targets = _batch()
    ref = build_mllm_reference(CFG, torch.float64)
    expected = ref.loss(inputs, targets)
    expected.backward()
    grads = {k: v.grad for k, v in ref.named_full().items()}
    n = 1 if partition is None else len(partition)
    stages = [build_mllm_stage(CFG, StagePlacement(s, n, dtype=torch.float64, partition=partition))
              for s in range(n)]
    x = inputs
    for st in stages:
        x = st.forward(0, x, targets if st.is_last else None)
    ratio = targets.numel() / int((targets != IGNORE_INDEX).sum())
    assert float(x) * ratio == pytest.approx(float(expected), rel=1e-12)
    g = None
    for st in reversed(stages):
        g = st.backward_full(0, g, ratio)
    names = [k for st in stages for k, _ in st.named_parameters()]
    assert sorted(names) == sorted(grads)
    for st in stages:
        for name, p in st.named_parameters():
            assert p.grad is not None and grads[name].abs().max() > 0, name
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-10, atol=1e-12)


def test_images_reach_the_loss_and_bad_inputs_are_refused():
    inputs, targets = _batch()
    ref = build_mllm_reference(CFG, torch.float64)
    blank = inputs.clone()
    blank[:, : CFG.vision.pixels] = 0
    assert float(ref.loss(blank, targets)) != float(ref.loss(inputs, targets))
    stage = build_mllm_stage(CFG, StagePlacement(0, 2))
    with pytest.raises(ValueError, match="pixel bytes"):
        stage.check_input(inputs[:, :10], None)
    with pytest.raises(ValueError, match="must be <= the decoder hidden"):
        MLLMConfig(VisionConfig(hidden=32), DEC)


def test_shape_images_are_seeded_and_captioned():
    a, b = ShapeImages(32, seed=3), ShapeImages(32, seed=3)
    (pa, ca), (pb, cb) = a.sample(7), b.sample(7)
    assert (pa == pb).all() and ca == cb and ca.startswith("a ")
    assert pa.shape == (32, 32, 3) and pa.max() > 0
    inputs, targets = _batch()
    n = CFG.vision.image_tokens
    assert (targets[:, :n] == IGNORE_INDEX).all() and (targets[:, n] == ord("a")).all()


def test_image_dependent_targets_are_the_bytes_the_image_decides():
    caption = "a top left red circle, a bottom right cyan triangle."
    marked = "".join(c for c, m in zip(caption, image_choices(caption), strict=True) if m)
    assert marked == "tlrc,brct."
    batches = CaptionBatches(ShapeImages(16, seed=5), CFG, text_len=60, batch_size=3)
    inputs, targets, choices = batches.image_batch(0)
    assert all(torch.equal(a, b) for a, b in zip(batches.batch(0), (inputs, targets), strict=True))
    assert choices.shape == targets.shape and choices.any(axis=1).all()
    assert (targets[choices] != IGNORE_INDEX).all()
    assert set(bytes(targets[choices].tolist()).decode()) <= set("tbl" "rgypc" "s,.")
