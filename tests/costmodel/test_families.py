"""The cost model's family table: each config finds its family's row, each row
prices its own spec, and the reports read a config through its family.

A family's answers stand in one row (stp.costmodel.pricing.FamilyPricing); these
tests hold the rows to the classes they name, so a row that prices a mixture of
experts as a plain decoder, or a spec no row claims, is caught here rather than as
a few percent in a byte count.
"""

import dataclasses

import pytest

from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.families import FAMILIES, config_facts, pricing_of, pricing_of_config
from stp.costmodel.mllm.spec import MLLMSpec
from stp.costmodel.moe.spec import MoESpec
from stp.shapes import MLLMConfig, ModelConfig, MoEConfig, VisionConfig


def _decoder() -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _moe() -> MoEConfig:
    return MoEConfig(vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     num_experts=4, top_k=2, expert_ffn=48, shared_expert_ffn=32)


def _mllm() -> MLLMConfig:
    vision = VisionConfig(image_size=16, patch_size=4, hidden=16, num_layers=2, num_heads=4)
    decoder = ModelConfig(vocab_size=81, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          max_seq_len=vision.image_tokens + 8)
    return MLLMConfig(vision, decoder)


def test_every_row_claims_classes_no_other_row_claims():
    specs = [f.spec_type for f in FAMILIES]
    configs = [f.config_type for f in FAMILIES]
    names = [f.name for f in FAMILIES]
    assert len(set(specs)) == len(specs) and len(set(configs)) == len(configs)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("config,spec_type,family", [
    (_decoder(), ModelSpec, "decoder"), (_moe(), MoESpec, "moe"), (_mllm(), MLLMSpec, "mllm"),
])
def test_a_config_is_priced_as_its_own_family(config, spec_type, family):
    spec = spec_from_config(config, seq_len=16, microbatch_size=2, tp=1)
    assert type(spec) is spec_type
    assert pricing_of(spec).name == pricing_of_config(config).name == family
    assert config_facts(config).family == family
    assert (spec.sequence, spec.micro_batch) == (16, 2)


def test_the_facts_read_the_config_through_its_family():
    moe, mllm = config_facts(_moe()), config_facts(_mllm())
    assert (moe.experts, moe.top_k, moe.vision) == (4, 2, None)
    assert (mllm.experts, mllm.decoder.num_layers, mllm.vision.num_layers) == (0, 2, 2)
    assert config_facts(_decoder()).decoder.hidden == 64


def test_a_config_no_family_knows_is_reported_as_a_decoder_and_not_priced():
    @dataclasses.dataclass
    class Custom:
        num_layers: int = 3
        hidden: int = 8

    assert pricing_of_config(Custom()) is None
    assert config_facts(Custom()).family == "decoder"
    with pytest.raises(ValueError, match="needs a model family's config, not a Custom"):
        spec_from_config(Custom(), seq_len=4)
    with pytest.raises(ValueError, match="no cost model for a Custom"):
        pricing_of(Custom())


def test_the_expert_answers_of_a_decoder_and_a_mixture_of_experts():
    dense = spec_from_config(_decoder(), seq_len=16)
    moe = spec_from_config(_moe(), seq_len=16)
    assert (dense.ep, dense.has_experts, dense.ep_sizes(), dense.a2a_copies) == (1, False, (1,),
                                                                                 0.0)
    assert dense.with_ep(1) is dense and dense.router_parameters() == 0.0
    with pytest.raises(ValueError, match="ep=2: expert parallelism needs a mixture-of-experts"):
        dense.with_ep(2)
    assert moe.has_experts and moe.ep_sizes() == (1, 2, 4)
    at2 = moe.with_ep(2)
    assert at2.ep == 2 and at2.a2a_copies == 2.0 and moe.a2a_copies == 0.0
    # router 64 x 4 and the shared expert's gate 64, every layer an MoE layer
    assert moe.router_parameters() == 64 * 4 + 64
