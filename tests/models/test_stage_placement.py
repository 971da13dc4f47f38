"""The placement record every family's stage builder takes (stp.models.placement):
a bad field is refused on construction, naming the value; the families' trainer
builders hand the mesh's words and the run's settings to their stage through it."""

from __future__ import annotations

import re

import pytest
import torch

from stp.models import ModelConfig, StagePlacement, build_stage
from stp.models.decoder.family import DECODER
from stp.models.mllm.family import MLLM
from stp.models.moe.family import MOE
from stp.models.placement import placed_builder
from stp.shapes.mllm import MLLMConfig, VisionConfig
from stp.shapes.moe import MoEConfig

CFG = ModelConfig(vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  ffn_hidden=64, max_seq_len=16, seed=3)


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(stage=0, num_stages=0), "num_stages must be an int >= 1, got 0"),
        (dict(stage=0, num_stages=True), "num_stages must be an int >= 1, got True"),
        (dict(stage=2, num_stages=2), "stage must be an int in [0, num_stages=2), got 2"),
        (dict(stage=-1, num_stages=2), "got -1"),
        (dict(stage=0, num_stages=1, tp_size=0), "tp_size must be an int >= 1, got 0"),
        (dict(stage=0, num_stages=1, tp_size=2, tp_rank=2),
         "tp_rank must be an int in [0, tp_size=2), got 2"),
        (dict(stage=0, num_stages=1, device="gpu0"), "device must be a torch.device or its "
         "name (cpu, cuda, cuda:1, ...), got 'gpu0'"),
        (dict(stage=0, num_stages=1, dtype="float32"), "dtype must be a floating torch.dtype, "
         "got 'float32'"),
        (dict(stage=0, num_stages=1, dtype=torch.int64), "got torch.int64"),
        (dict(stage=0, num_stages=2, partition=3), "partition must be a tuple of layer counts, "
         "got 3"),
        (dict(stage=0, num_stages=1, sequence_parallel="yes"),
         "sequence_parallel must be a bool, got 'yes'"),
        (dict(stage=0, num_stages=1, recompute="half"), "recompute 'half': choose one of"),
        (dict(stage=0, num_stages=1, tp_overlap_chunks=-1),
         "tp_overlap_chunks must be an int >= 0 (0: no overlap), got -1"),
        (dict(stage=0, num_stages=1, tp_overlap_chunks=2.0), "got 2.0"),
    ],
)
def test_a_bad_field_is_refused_naming_it(fields: dict, needle: str):
    with pytest.raises(ValueError, match=re.escape(needle)):
        StagePlacement(**fields)


def test_the_record_is_frozen_and_normalised():
    p = StagePlacement(1, 3, device="cpu", partition=[1, 2, 1])
    assert p.device == torch.device("cpu") and p.partition == (1, 2, 1)
    assert (p.is_first, p.is_last) == (False, False)
    assert p.layers(4) == range(1, 3)
    assert StagePlacement(2, 3).layers(7) == range(5, 7)  # the even split: 3, 2, 2
    assert p.tp_overlap_chunks == 0
    with pytest.raises(AttributeError):
        p.stage = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="sum"):
        p.layers(5)  # the partition covers 4 layers


def test_sequence_parallelism_is_in_effect_only_over_tp_ranks():
    assert not StagePlacement(0, 1, sequence_parallel=True).shards_sequence
    assert StagePlacement(0, 1, tp_size=2, sequence_parallel=True).shards_sequence
    assert not StagePlacement(0, 1, tp_size=2).shards_sequence


def test_the_stage_reads_its_place_from_the_record():
    p = StagePlacement(1, 2, dtype=torch.float64, partition=(3, 1), recompute="full")
    st = build_stage(CFG, p)
    assert st.placement is p
    assert (st.stage, st.num_stages, st.layer_ids) == (1, 2, range(3, 4))
    assert st.recompute == "full" and st.is_last and not st.is_first
    assert {t.dtype for t in st.parameters()} == {torch.float64}


def test_placed_builder_completes_the_placement_and_forwards_the_rest():
    seen = []

    def build(config, placement, **family):
        seen.append((config, placement, family))
        return "stage"

    builder = placed_builder(build, "cfg", partition=(1, 1), recompute="selective",
                             weights="reader")
    assert builder(1, 2, tp_size=2, tp_rank=1, dtype=torch.float64, extra=5) == "stage"
    ((config, p, family),) = seen
    assert config == "cfg" and family == {"weights": "reader", "extra": 5}
    assert p == StagePlacement(1, 2, tp_size=2, tp_rank=1, dtype=torch.float64,
                               partition=(1, 1), recompute="selective")


def _mllm() -> MLLMConfig:
    dec = ModelConfig(vocab_size=32, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden=64, max_seq_len=64, seed=3)
    return MLLMConfig(VisionConfig(image_size=16, num_layers=1), dec)


@pytest.mark.parametrize("family,config,how", [
    (DECODER, CFG, dict(partition=(3, 1), recompute="selective")),
    (MOE, MoEConfig(vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    ffn_hidden=64, max_seq_len=16, num_experts=4, top_k=2, expert_ffn=32),
     dict(partition=(3, 1))),
    (MLLM, _mllm(), dict(partition=(2, 1), recompute="full")),
])
def test_each_family_builds_the_stage_its_trainer_call_names(family, config, how):
    builder = family.stage_builder(config, 2, **how)
    st = builder(1, 2, tp_group=None, tp_size=1, tp_rank=0, device="cpu", dtype=torch.float64)
    want = StagePlacement(1, 2, dtype=torch.float64, **how)
    assert st.placement == want
    assert st.layer_ids == want.layers(family.num_layers(config))
    assert st.recompute == how.get("recompute", "none")
