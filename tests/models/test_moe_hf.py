"""Qwen2-MoE and Mixtral in and out: stp.models.hf.load(dir) computes what transformers
computes, and stp's saved checkpoints load in transformers.

Tiny random models built by transformers (tests/models/_hf_moe.py), float64,
weights re-drawn with visible scales. transformers computes the router softmax
in float32 even in a float64 model (stp in float64 there), so the bar is 1e-6
relative (observed ~2e-7):
- logits; the language-model loss; transformers' `aux_loss` (every layer's router
  logits concatenated: `hf_aux_loss`); with one MoE layer and one microbatch
  stp's own training aux loss is that number too;
- the gradient of loss + coef x aux of every parameter;
- `save_state` of a loaded model and of a fresh stp model (both layouts) loads in
  transformers with no missing or unexpected keys and the same logits;
- negative controls: top-k renormalisation flipped, two experts swapped: caught.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import _hf_moe
import pytest
import torch

from stp.models import hf
from stp.models.moe.reference import build_moe_reference
from stp.shapes.moe import MoEConfig

F64 = torch.float64
TOL = 1e-6
KINDS = ("qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for i, kind in enumerate(KINDS):
        out[kind] = root / kind
        _hf_moe.build_moe(kind, out[kind], seed=i)
    out["mixtral-1"] = root / "mixtral-1"  # one MoE layer
    _hf_moe.build_moe("mixtral", out["mixtral-1"], seed=2, num_hidden_layers=1)
    return out


def _batch(vocab: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (3, 20), generator=g),
            torch.randint(0, vocab, (3, 20), generator=g))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_loss_aux_and_gradients_match_transformers(
    kind: str, moe_checkpoints: dict[str, Path]
) -> None:
    ref = hf.load(moe_checkpoints[kind], dtype=F64)
    theirs = _hf_moe.load_moe(moe_checkpoints[kind])
    tokens, targets = _batch(ref.config.vocab_size)
    out = theirs(input_ids=tokens, output_router_logits=True)
    assert _rel(ref.logits(tokens), out.logits) < TOL
    their_loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    loss = ref.loss(tokens, targets)
    assert abs(loss.item() - their_loss.item()) < TOL * their_loss.item()
    aux = ref.hf_aux_loss(tokens)
    assert abs(aux.item() - out.aux_loss.item()) < TOL * out.aux_loss.item()
    coef = ref.config.aux_loss_coef
    assert coef == theirs.config.router_aux_loss_coef
    (ref.loss(tokens, targets) + coef * ref.hf_aux_loss(tokens)).backward()
    (their_loss + coef * out.aux_loss).backward()
    theirs_grads = _their_grads(theirs, ref.config)
    mine = dict(ref.named_parameters())
    assert set(mine) == set(theirs_grads)  # every parameter compared
    for name, p in mine.items():
        assert _rel(p.grad, theirs_grads[name]) < 10 * TOL, name


def _their_grads(theirs: torch.nn.Module, c: MoEConfig) -> dict[str, torch.Tensor]:
    """transformers' gradients under stp's names: its fused experts in memory
    (gate_up_proj [E, 2f, h], down_proj [E, h, f]) cut back into experts; its
    per-expert keys on disk are checked by the save tests."""
    grads = {n: p.grad for n, p in theirs.named_parameters()}
    out = {}
    for i in range(c.num_layers):
        fused = f"model.layers.{i}.mlp.experts."
        if fused + "gate_up_proj" in grads:
            gate_up, down = grads.pop(fused + "gate_up_proj"), grads.pop(fused + "down_proj")
            f = c.expert_ffn
            for e in range(c.num_experts):
                m = f"layers.{i}.moe.experts.{e}."
                out[m + "w1.weight"], out[m + "w3.weight"] = gate_up[e, :f], gate_up[e, f:]
                out[m + "w2.weight"] = down[e]
        gate = grads.pop(f"model.layers.{i}.mlp.gate.weight", None)
        if gate is not None:
            out[f"layers.{i}.moe.router.weight"] = gate
    for key, g in grads.items():
        out[hf.stp_name(key, c.hf_type)] = g
    return out


def test_stp_aux_loss_is_transformers_with_one_moe_layer(
    moe_checkpoints: dict[str, Path]
) -> None:
    ref = hf.load(moe_checkpoints["mixtral-1"], dtype=F64)
    theirs = _hf_moe.load_moe(moe_checkpoints["mixtral-1"])
    tokens, _ = _batch(ref.config.vocab_size)
    with torch.no_grad():
        want = theirs(input_ids=tokens, output_router_logits=True).aux_loss.item()
        assert abs(ref.aux_loss(tokens, chunks=1).item() - want) < TOL * want
        # microbatches average their own losses: not transformers' number any more
        assert abs(ref.aux_loss(tokens, chunks=3).item() - want) > 1e3 * TOL * want


def _save_and_reload(ref: torch.nn.Module, config: MoEConfig, out: Path,
                     source: Path | None = None) -> None:
    state = {n: p.detach() for n, p in ref.named_parameters()}
    hf.save_state(out, state, config, source=None if source is None else
                  hf.HFCheckpoint.open(source))
    from transformers import AutoModelForCausalLM

    theirs, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=F64, experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens, _ = _batch(config.vocab_size)
    with torch.no_grad():
        assert _rel(ref.logits(tokens), theirs.eval()(input_ids=tokens).logits) < TOL
    back = hf.load(out, dtype=F64)
    if config.hf_type == "mixtral":  # no dense layer: config.json has no dense width
        config = dataclasses.replace(config, ffn_hidden=config.expert_ffn)
    assert back.config == config


@pytest.mark.parametrize("kind", KINDS)
def test_a_loaded_model_saves_back(kind: str, moe_checkpoints: dict[str, Path],
                                   tmp_path: Path) -> None:
    ref = hf.load(moe_checkpoints[kind], dtype=F64)
    _save_and_reload(ref, ref.config, tmp_path / "out", source=moe_checkpoints[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_stp_model_saves_in_its_layout(kind: str, tmp_path: Path) -> None:
    extra = dict(shared_expert_ffn=8, moe_every=2, norm_topk_prob=False, qkv_bias=True) if (
        kind == "qwen2_moe") else {}
    config = MoEConfig(vocab_size=40, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1,
                       ffn_hidden=24, max_seq_len=32, init_std=0.3, num_experts=3, top_k=2,
                       expert_ffn=8, hf_type=kind, **extra)
    _save_and_reload(build_moe_reference(config, F64), config, tmp_path / "out")


def test_a_qwen2_moe_layout_needs_a_shared_expert(tmp_path: Path) -> None:
    config = MoEConfig(vocab_size=40, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1,
                       num_experts=3, top_k=2, expert_ffn=8, moe_every=2)
    with pytest.raises(ValueError, match="shared expert"):
        hf.save_state(tmp_path / "out", dict(build_moe_reference(config).named_parameters()),
                      config)


def _swap_experts(t: dict[str, torch.Tensor], c: MoEConfig) -> None:
    for w in ("w1", "w3", "w2"):
        a, b = f"layers.1.moe.experts.0.{w}.weight", f"layers.1.moe.experts.1.{w}.weight"
        t[a], t[b] = t[b], t[a]


@pytest.mark.parametrize("control", ["norm_topk_prob flipped", "experts swapped"])
def test_negative_controls_are_caught(control: str, moe_checkpoints: dict[str, Path]) -> None:
    ckpt = hf.HFCheckpoint.open(moe_checkpoints["qwen2_moe"])
    config, tensors = ckpt.config, ckpt.full_tensors(F64)
    if control == "experts swapped":
        _swap_experts(tensors, config)
    else:
        config = dataclasses.replace(config, norm_topk_prob=not config.norm_topk_prob)
    wrong = build_moe_reference(config, F64, tensors)
    theirs = _hf_moe.load_moe(moe_checkpoints["qwen2_moe"])
    tokens, _ = _batch(config.vocab_size)
    with torch.no_grad():
        assert _rel(wrong.logits(tokens), theirs(input_ids=tokens).logits) > 1e3 * TOL


@pytest.mark.parametrize("field, value, says", [
    ("mlp_only_layers", [0], "mlp_only_layers"),
    ("router_jitter_noise", 0.1, "router_jitter_noise"),
    ("num_experts_per_tok", 9, "top_k=9 must be <= num_experts=4"),
    ("num_experts", 10**6, "num_experts=1000000 is not accepted"),
])
def test_configs_stp_would_compute_differently_are_refused(field: str, value: object,
                                                           says: str) -> None:
    from stp.models.hf.moe_config import moe_config_from_hf

    raw = _hf_moe.qwen2_moe_config().to_dict()
    raw[field] = value
    with pytest.raises(ValueError, match=says.replace("[", r"\[")) as err:
        moe_config_from_hf(raw, "cfg.json")
    assert str(err.value).startswith("cfg.json: ") and "\n" not in str(err.value)
