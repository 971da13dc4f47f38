"""The free-space check before training sizes a checkpoint by the model's family: an MoE
with its routed and shared experts, a multimodal model with its encoder and merger
(the decoder's parameter list gave the multimodal model 0 bytes, so no check, and an
MoE its size without experts)."""

from __future__ import annotations

import collections

import pytest
import torch

from stp.models import ModelConfig
from stp.shapes.mllm import MLLMConfig, VisionConfig
from stp.shapes.moe import MoEConfig
from stp.train.checkpoint import storage
from stp.train.families import family_of
from stp.train.run import job as job_mod

DENSE = ModelConfig(vocab_size=64, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1,
                    ffn_hidden=32, max_seq_len=16)
MOE = MoEConfig(vocab_size=64, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1,
                ffn_hidden=32, max_seq_len=16, num_experts=4, top_k=2, expert_ffn=8,
                shared_expert_ffn=12)
MLLM = MLLMConfig(VisionConfig(image_size=16, patch_size=2, merge=2, hidden=4, num_layers=2,
                               num_heads=2), DENSE)


def _reference_count(config) -> int:
    """Parameters of the single-process reference, each tensor once (independent of the
    specs the family counts from)."""
    model = family_of(config).model.reference(config, torch.float32)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", [DENSE, MOE, MLLM], ids=["decoder", "moe", "mllm"])
def test_parameter_count_equals_the_reference_models(config) -> None:
    assert family_of(config).model.parameter_count(config) == _reference_count(config)


def test_moe_counts_routed_and_shared_experts() -> None:
    """By hand: each MoE layer replaces the dense MLP (3 h f) with E routed experts
    (3 h f_e each), a shared expert (3 h f_s), its sigmoid gate (h) and the router (E h)."""
    h, f, e, fe, fs = 16, 32, 4, 8, 12
    per_layer = 3 * h * fe * e + 3 * h * fs + h + e * h - 3 * h * f
    dense = family_of(DENSE).model.parameter_count(DENSE)
    assert family_of(MOE).model.parameter_count(MOE) == dense + 2 * per_layer


def test_mllm_counts_its_encoder_and_merger() -> None:
    dense = family_of(DENSE).model.parameter_count(DENSE)
    assert family_of(MLLM).model.parameter_count(MLLM) > dense
    assert storage.checkpoint_bytes(family_of(MLLM).model.parameter_count(MLLM), "float32") > 0


@pytest.mark.parametrize("config", [MOE, MLLM], ids=["moe", "mllm"])
def test_a_disk_too_small_for_the_family_is_refused_before_training(config, tmp_path,
                                                                   monkeypatch) -> None:
    usage = collections.namedtuple("usage", "total used free")
    params = family_of(config).model.parameter_count(config)
    free = storage.checkpoint_bytes(params, "float32")  # without the margin: too small
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage(10**9, 0, free))
    from stp.train.run.config import TrainJob

    with pytest.raises(storage.StorageFault, match="--out"):
        job_mod._check_training(TrainJob(out=str(tmp_path / "out")), config)
