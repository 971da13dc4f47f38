"""Recomputation unit by unit, in one process (stp.models.recompute): a stage built with
`recompute` selective or full gives the bit-identical loss and weight gradients of
the stage built without it (float64, torch.equal), with its layers fused into one
unit (one TP rank) and cut into units, for a split backward (B then W later) and
a full backward; a full stage keeps only the units' inputs between F and B; the
multimodal model's encoder units the same. A bad mode is one line naming the
modes, from the stage builder and from TrainerOptions."""

from __future__ import annotations

import pytest
import torch

from stp.models import ModelConfig, StagePlacement
from stp.models.decoder.stage import build_stage
from stp.runtime.graph_saved import graph_saved

CONFIG = ModelConfig(vocab_size=32, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     ffn_hidden=64, max_seq_len=16, seed=3, qkv_bias=True)


def _kept_bytes(stage, mb: int) -> int:
    """Bytes a microbatch keeps from F to B (the unit's tensors and their graphs'
    saved tensors, parameters and rotary tables left out), as the offloader counts."""
    shared = {t.untyped_storage().data_ptr()
              for t in (*stage.parameters(), *stage.shared_tensors())}
    kept = stage.kept_tensors(mb)
    tensors = [*kept, *graph_saved([t for t in kept if t.grad_fn is not None])]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr not in shared)


def _run(stage, inputs, targets):
    losses = [stage.forward(mb, x, t) for mb, (x, t) in enumerate(zip(inputs, targets,
                                                                      strict=True))]
    kept = _kept_bytes(stage, 0)
    stage.backward_full(0, None, 0.5)
    stage.backward_input(1, None, 0.5)
    stage.backward_weight(1)
    return losses, {n: p.grad for n, p in stage.named_parameters()}, kept


@pytest.mark.parametrize("fuse", [True, False], ids=["one-unit", "units"])
def test_decoder_stage_recomputes_the_same_bits_and_full_keeps_less(fuse: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(2)]
    targets = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(2)]
    runs = {mode: _run(build_stage(CONFIG, StagePlacement(0, 1, dtype=torch.float64,
                                                          recompute=mode), fuse_layers=fuse),
                       inputs, targets)
            for mode in ("none", "selective", "full")}
    losses, grads, kept = runs["none"]
    for mode in ("selective", "full"):
        got_losses, got_grads, _ = runs[mode]
        assert all(torch.equal(a, b) for a, b in zip(got_losses, losses, strict=True)), mode
        assert grads.keys() == got_grads.keys()
        assert all(torch.equal(got_grads[n], grads[n]) for n in grads), mode
    assert runs["selective"][2] < kept  # the core's log-sum-exp
    # full: the units' inputs only (the embedding's masks, one [2, 8, 32] float64 per
    # unit: two layers' attention and MLP, and the loss head's; fused: one for the layers)
    rows = 2 * 8 * 32 * 8
    inputs_kept = rows * (2 if fuse else 5)
    assert inputs_kept <= runs["full"][2] < inputs_kept + 1024, runs["full"][2]


def test_multimodal_stage_recomputes_the_same_bits() -> None:
    from stp.models.mllm.stage import build_mllm_stage
    from stp.train.families.mllm import mllm_batches
    from stp.train.run.config import ModelShape, TrainJob, VisionShape
    from stp.train.run.job import model_config

    job = TrainJob(arch="mllm", model=ModelShape(layers=2, hidden=32, heads=4, seq_len=12),
                   vision=VisionShape(image_size=8, patch=2, vision_layers=2, vision_hidden=8),
                   microbatches=2, microbatch_size=1, dtype="float64")
    cfg = model_config(job)
    tokens, targets = mllm_batches(job, cfg).batch(0)
    runs = {mode: _run(build_mllm_stage(cfg, StagePlacement(0, 1, dtype=torch.float64,
                                                            recompute=mode)),
                       tokens.split(1), targets.split(1))
            for mode in ("none", "selective", "full")}
    losses, grads, kept = runs["none"]
    for mode in ("selective", "full"):
        got_losses, got_grads, got_kept = runs[mode]
        assert all(torch.equal(a, b) for a, b in zip(got_losses, losses, strict=True)), mode
        assert all(torch.equal(got_grads[n], grads[n]) for n in grads), mode
        assert got_kept < kept, (mode, got_kept, kept)


def test_a_bad_mode_is_one_line_naming_the_modes() -> None:
    from stp.train.run.parts import TrainerOptions

    with pytest.raises(ValueError, match=r"^recompute 'half': choose one of none, selective, "
                                         r"full$"):
        build_stage(CONFIG, StagePlacement(0, 1, recompute="half"))
    with pytest.raises(ValueError, match=r"^recompute 'half': choose one of"):
        TrainerOptions(recompute="half")


def test_a_stage_builder_refuses_recompute() -> None:
    from stp.train.run.parts import TrainerOptions
    from stp.train.run.setup import stage_builder

    with pytest.raises(ValueError, match="recompute='full' needs a model config"):
        stage_builder(lambda *a, **k: None, TrainerOptions(recompute="full", hidden=8), 2, 1)
