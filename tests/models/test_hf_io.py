"""Checkpoints in and out on one process: load -> save bit for bit, transformers
loads what stp writes (also stp's own model), a stage built from a checkpoint
with masked targets, bad checkpoints refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _hf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from stp.models import (
    ModelConfig,
    StagePlacement,
    build_reference,
    build_stage,
    hf,
    valid_token_ratio,
)

F64 = torch.float64


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_load_then_save_round_trips_bit_for_bit(
    kind: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints[kind]
    ckpt = hf.HFCheckpoint.open(src)
    model = hf.load(src, dtype=F64)
    bound = 12_000
    hf.save_state(tmp_path, _state(model), model.config, source=ckpt, max_shard_bytes=bound)
    before, after = _tensors(src), _tensors(tmp_path)
    assert sorted(before) == sorted(after)
    for key, t in before.items():
        assert t.dtype == after[key].dtype and torch.equal(t, after[key]), key
    files = sorted(tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    for f in files:  # bounded, unless one tensor alone is larger
        with safe_open(f, "pt") as h:
            keys = list(h.keys())  # noqa: SIM118 (not a dict)
        assert f.stat().st_size <= bound + 2_000 or len(keys) == 1
    assert json.loads((tmp_path / "config.json").read_text()) == {
        **json.loads((src / "config.json").read_text()), "dtype": "float64"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (src / name).read_bytes()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_transformers_loads_what_stp_saves(
    kind: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A changed model saved by stp: no missing, unexpected or mismatched keys, and
    transformers' logits equal stp's."""
    from transformers import AutoModelForCausalLM

    model = hf.load(checkpoints[kind], dtype=F64)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    hf.save_state(tmp_path, _state(model), model.config,
                  source=hf.HFCheckpoint.open(checkpoints[kind]))
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F64,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    tokens = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, their = model.logits(tokens), _hf.float64_everywhere(theirs)(input_ids=tokens).logits
    assert float((mine - their).abs().max() / their.abs().max()) < 1e-12


def test_stp_own_model_is_served_as_a_llama(tmp_path: Path) -> None:
    """Pretrain-then-serve: stp's byte-level model written without a source checkpoint
    is a Llama transformers computes identically."""
    from transformers import AutoModelForCausalLM

    config = ModelConfig(vocab_size=256, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         max_seq_len=32, seed=3)
    model = build_reference(config, F64)
    hf.save_state(tmp_path, _state(model), config)
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F64,
                                                        output_loading_info=True)
    assert type(theirs).__name__ == "LlamaForCausalLM" and not info["missing_keys"]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        their = _hf.float64_everywhere(theirs)(input_ids=tokens).logits
        assert float((model.logits(tokens) - their).abs().max() / their.abs().max()) < 1e-12


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stage_from_checkpoint_with_ignored_targets_matches_reference(
    kind: str, checkpoints: dict[str, Path]
) -> None:
    """One stage read through the slicing reader: its loss (sum over valid tokens /
    positions) times valid_token_ratio is the reference's mean over valid tokens, and
    with the executor's seed scaled alike its gradients are the reference's (a tied
    head's gradient adds to the embedding's)."""
    ckpt = hf.HFCheckpoint.open(checkpoints[kind])
    ref = hf.load(checkpoints[kind], dtype=F64)
    stage = build_stage(ckpt.config, StagePlacement(0, 1, dtype=F64), weights=ckpt.read)
    g = torch.Generator().manual_seed(2)
    tokens, targets = torch.randint(0, 90, (2, 16), generator=g), torch.randint(0, 90, (2, 16),
                                                                                 generator=g)
    tokens[0, :3] = 0  # Llama's pad token: looked up, its row not trained
    targets[0, :11] = -100
    ratio = valid_token_ratio(targets)
    loss = stage.forward(0, tokens, targets)
    stage.backward_full(0, None, scale=ratio)
    expected = ref.loss(tokens, targets)
    expected.backward()
    assert abs(float(loss) * ratio - expected.item()) < 1e-12 * expected.item()
    mine = {n: p.grad for n, p in stage.named_parameters()}
    if ckpt.config.tie_embeddings:
        mine["embed.weight"] = mine["embed.weight"] + mine.pop("head.weight")
    for name, p in ref.named_parameters():
        assert float((mine[name] - p.grad).abs().max()) <= 1e-12 * float(p.grad.abs().max()), name
    if ckpt.config.pad_token_id is not None:
        assert float(mine["embed.weight"][ckpt.config.pad_token_id].abs().max()) == 0.0


def _broken(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    if how == "shape":
        raw["intermediate_size"] = 48
    elif how == "architecture":
        raw["model_type"] = "gpt2"
    if how in ("shape", "architecture"):
        (dst / "config.json").write_text(json.dumps(raw))
    elif how == "missing tensor":
        t = load_file(dst / "model.safetensors")
        del t["model.layers.3.mlp.up_proj.weight"]
        save_file(t, dst / "model.safetensors")
    elif how == "no config":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize(
    "how,needle",
    [
        ("shape", "model.layers.0.mlp.gate_proj.weight has shape [64, 32], but config.json "
         "implies [48, 32]"),
        ("architecture", "model_type='gpt2' is not supported"),
        ("missing tensor", "model.layers.3.mlp.up_proj.weight is missing"),
        ("no config", "config.json is missing"),
    ],
)
def test_bad_checkpoints_are_refused_naming_the_path(
    how: str, needle: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    bad = _broken(checkpoints["llama"], tmp_path / "bad", how)
    with pytest.raises(ValueError) as err:
        hf.HFCheckpoint.open(bad)
    assert needle in str(err.value) and str(bad) in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        hf.load(tmp_path / "missing")


def test_trainer_refuses_a_transformers_module_in_one_line(checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from stp.train.step.trainer import Trainer

    module = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    with pytest.raises(ValueError) as err:
        Trainer(module, pp=1)
    text = str(err.value)
    assert "\n" not in text and "LlamaForCausalLM" in text
    assert "ModelConfig" in text and "init_from" in text
