"""What a stage may offer beyond the four passes (stp.runtime.stage_api.StageOffers):
a stage that offers nothing gets each member's default, a stage that offers one
gets its own; and the family protocol's defaults (stp.models.family)."""

from types import SimpleNamespace

import pytest
import torch

from stp.models.decoder.family import DECODER
from stp.models.mllm.family import MLLM
from stp.models.moe.family import MOE
from stp.runtime import stage_api as api
from stp.shapes import ModelConfig, MoEConfig


class Bare:
    """A user's stage: the passes only (none needed here)."""


def test_a_stage_that_offers_nothing_gets_the_defaults():
    st = Bare()
    assert api.expert_names(st) == frozenset()
    assert api.stage_units(st) == ()
    assert api.full_shape(st, "w") is None
    assert api.prepares_gathers(st) is False
    assert api.ties_head_to_embedding(st) is False
    assert api.kept_tensors(st) is None
    assert api.shared_tensors(st) == []
    assert api.take_gathers(st) == []
    assert api.offers_aux(st) is False
    assert api.shard_slice(st, "w") is None
    api.weights_in_backward(st, [0, 1])  # nothing to tell, nothing raised
    api.check_input(st, torch.zeros(1), None)
    api.reset(st)
    parts = [torch.ones(2, 1), torch.zeros(2, 1)]
    assert torch.equal(api.unshard(st, "w", parts, 1), torch.cat(parts, dim=1))


def test_a_stage_that_offers_a_member_gets_its_own():
    told, checked, reset = [], [], []
    weight, table = torch.ones(2), torch.zeros(3)
    st = SimpleNamespace(
        expert_names=frozenset({"layers.0.moe.experts.0.w1"}), units=("u0", "u1"),
        specs={"w": SimpleNamespace(shape=(4, 6))}, prepares_gathers=True,
        config=SimpleNamespace(tie_embeddings=True),
        weights_in_backward=lambda mbs: told.extend(mbs),
        kept_tensors=lambda mb: [weight], parameters=lambda: [weight],
        shared_tensors=lambda: [table], check_input=lambda x, t: checked.append(x.shape),
        take_gathers=lambda: [(0.0, 1.0, 0.5)], take_aux=lambda: None,
        reset=lambda: reset.append(True), shard_slice=lambda name: f"slice of {name}",
        unshard=lambda name, parts: torch.stack(parts))
    assert api.expert_names(st) == {"layers.0.moe.experts.0.w1"}
    assert api.stage_units(st) == ("u0", "u1")
    assert api.full_shape(st, "w") == (4, 6) and api.full_shape(st, "v") is None
    assert api.prepares_gathers(st) and api.ties_head_to_embedding(st) and api.offers_aux(st)
    kept = api.kept_tensors(st)
    assert kept is not None and kept(0) == [weight]
    assert api.shared_tensors(st) == [weight, table]
    assert api.take_gathers(st) == [(0.0, 1.0, 0.5)]
    assert api.shard_slice(st, "w") == "slice of w"
    api.weights_in_backward(st, iter([2, 5]))
    api.check_input(st, torch.zeros(2, 3), None)
    api.reset(st)
    assert told == [2, 5] and checked == [(2, 3)] and reset == [True]
    parts = [torch.ones(2), torch.zeros(2)]
    assert api.unshard(st, "w", parts, 0).shape == (2, 2)  # its own join, not a cat


def test_a_stage_that_is_not_cut_checks_its_input_through_its_own_check():
    seen = []
    st = SimpleNamespace(stage=0, is_first=True, is_last=False,
                         check_input=lambda x, t: seen.append(tuple(x.shape)))
    api.as_unit_stage(st).check_input(torch.zeros(1, 4), None)
    assert seen == [(1, 4)]


TINY = dict(vocab_size=64, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
            ffn_hidden=64, max_seq_len=16)


def test_a_family_without_experts_takes_only_ep_1():
    config = ModelConfig(**TINY)
    DECODER.check_ep(config, 1)
    with pytest.raises(ValueError, match="--ep 2: expert parallelism needs a mixture-of-experts"):
        DECODER.check_ep(config, 2)


def test_the_moe_family_splits_its_experts_over_ep():
    config = MoEConfig(**TINY, num_experts=6, top_k=2, expert_ffn=16)
    MOE.check_ep(config, 3)
    with pytest.raises(ValueError, match="--experts 6 must be divisible by --ep 4"):
        MOE.check_ep(config, 4)


def test_only_the_moe_family_binds_its_builder_to_the_expert_group():
    def builder(*a, **kw):
        return kw

    one = SimpleNamespace(dims=SimpleNamespace(ep=1))
    assert DECODER.builder_on_mesh(builder, one) is builder
    assert MOE.builder_on_mesh(builder, one) is builder
    assert MLLM.builder_on_mesh(builder, SimpleNamespace(dims=SimpleNamespace(ep=2))) is builder


def test_only_the_multimodal_family_refuses_the_hugging_face_format():
    assert DECODER.hf_refusal is None and MOE.hf_refusal is None
    assert "no Hugging Face layout" in MLLM.hf_refusal
