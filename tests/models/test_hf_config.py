"""config.json <-> ModelConfig, names, and the TP slices real checkpoints need:
a padded vocabulary, replicated kv heads."""

from __future__ import annotations

import json
import re

import _hf
import pytest
import torch

from stp.models import ModelConfig, RopeScaling, parameter_specs
from stp.models.decoder.init import init_full, init_shard, tp_slice
from stp.models.decoder.stage_shards import unshard
from stp.models.hf import config_from_hf, config_to_hf, hf_name, stp_name


def _raw(kind: str, **kw) -> dict:
    cfg = _hf.llama_config(**kw) if kind == "llama" else _hf.qwen2_config(**kw)
    return json.loads(cfg.to_json_string())


def test_llama_config_maps_every_field() -> None:
    c = config_from_hf(_raw("llama"))
    assert (c.vocab_size, c.hidden, c.num_layers, c.num_heads, c.num_kv_heads, c.ffn) == (
        99, 32, 4, 4, 2, 64)
    assert c.head_dim == 12 and c.explicit_head_dim == 12  # != 32 / 4
    assert (c.norm_eps, c.rope_theta, c.max_seq_len, c.pad_token_id) == (1e-5, 5e5, 64, 0)
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert not c.qkv_bias and not c.tie_embeddings


def test_qwen2_config_has_bias_and_tied_embeddings() -> None:
    c = config_from_hf(_raw("qwen2"))
    assert c.qkv_bias and c.tie_embeddings and c.rope_scaling is None
    assert (c.rope_theta, c.num_kv_heads, c.explicit_head_dim) == (1e6, 1, None)


def test_older_rope_spelling_is_read() -> None:
    """rope_theta + rope_scaling at top level (transformers < 5 checkpoints)."""
    raw = _raw("llama")
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    assert config_from_hf(raw) == config_from_hf(_raw("llama"))


@pytest.mark.parametrize(
    "kind,change,field",
    [
        ("llama", {"model_type": "mistral"}, "model_type='mistral'"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("qwen2", {"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ("llama", {"num_local_experts": 8}, "num_local_experts=8"),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         "rope_parameters.rope_type='yarn'"),
        ("llama", {"quantization_config": {"bits": 4}}, "quantization_config"),
    ],
)
def test_unsupported_fields_are_refused_by_name(kind: str, change: dict, field: str) -> None:
    raw = {**_raw(kind), **change}
    with pytest.raises(ValueError, match=re.escape(field)):
        config_from_hf(raw, "x/config.json")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_config_round_trips_through_a_fresh_config_json(kind: str) -> None:
    """Writing a fresh config.json (no source) and reading it back gives the model
    again; transformers reads it as the same architecture."""
    from transformers import AutoConfig

    c = config_from_hf(_raw(kind))
    raw = config_to_hf(c, "float32")
    assert config_from_hf(raw) == c
    theirs = AutoConfig.for_model(**raw)
    assert theirs.model_type == kind and theirs.num_hidden_layers == c.num_layers


def test_a_source_config_is_kept_and_its_dtype_updated() -> None:
    raw = _raw("qwen2")
    out = config_to_hf(config_from_hf(raw), "bfloat16", raw)
    assert out["dtype"] == "bfloat16" and out["max_window_layers"] == raw["max_window_layers"]


def test_names_map_both_ways() -> None:
    c = ModelConfig(num_layers=2, qkv_bias=True)
    for spec in parameter_specs(c):
        assert stp_name(hf_name(spec.name)) == spec.name
    assert hf_name("layers.1.mlp.w1.weight") == "model.layers.1.mlp.gate_proj.weight"
    assert hf_name("layers.0.attn.wk.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert stp_name("model.rotary_emb.inv_freq") is None
    with pytest.raises(ValueError, match="no Hugging Face name"):
        hf_name("layers.0.attn.wz.weight")


@pytest.mark.parametrize("vocab,tp", [(99, 2), (10, 4), (5, 4), (256, 4)])
def test_padded_vocabulary_slices_cover_it_once(vocab: int, tp: int) -> None:
    """Each rank holds padded_vocab / tp rows: the real ones of its range, then zeros;
    unsharding drops the padding and gives the full tensor back."""
    c = ModelConfig(vocab_size=vocab, hidden=8, num_heads=2, num_kv_heads=2, num_layers=1)
    spec = parameter_specs(c)[0]
    assert spec.name == "embed.weight"
    parts = [init_shard(c, spec, tp, r, dtype=torch.float64) for r in range(tp)]
    assert {p.shape[0] for p in parts} == {c.padded_vocab(tp) // tp}
    for r, p in enumerate(parts):
        w = tp_slice(c, spec, tp, r)
        assert torch.all(p[w.stop - w.start :] == 0)
    assert torch.equal(unshard(c, spec, parts), init_full(c, spec, torch.float64))


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    """2 kv heads on tp=4: ranks 0, 1 hold kv head 0, ranks 2, 3 kv head 1 (whose
    query heads 4..7 live on ranks 2, 3)."""
    c = ModelConfig(vocab_size=16, hidden=64, num_heads=8, num_kv_heads=2, num_layers=1)
    spec = next(s for s in parameter_specs(c) if s.name.endswith("wk.weight"))
    starts = [tp_slice(c, spec, 4, r).start for r in range(4)]
    assert starts == [0, 0, c.head_dim, c.head_dim]
    parts = [init_shard(c, spec, 4, r) for r in range(4)]
    assert torch.equal(parts[0], parts[1]) and not torch.equal(parts[1], parts[2])
    assert torch.equal(unshard(c, spec, parts), init_full(c, spec, torch.float32))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"explicit_head_dim": 7}, "explicit_head_dim=7 must be even"),
        ({"pad_token_id": 300}, "pad_token_id=300 must be < vocab_size=256"),
        ({"qkv_bias": 1}, "qkv_bias must be a bool"),
        ({"rope_scaling": {"factor": 8}}, "rope_scaling must be a RopeScaling"),
    ],
)
def test_bad_new_config_fields_raise(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        ModelConfig(**kwargs)


def test_explicit_head_dim_lifts_the_divisibility_rule() -> None:
    c = ModelConfig(hidden=30, num_heads=4, num_kv_heads=2, explicit_head_dim=8)
    assert c.head_dim == 8
