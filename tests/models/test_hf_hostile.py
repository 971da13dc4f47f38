"""Hostile Hugging Face checkpoint directories: every refusal is one ValueError line
naming the file or field, found in bounded time and memory (no weights are built).

The checkpoints are tiny stp models written by stp.models.hf.save_state (no
transformers import); a config field is then edited in config.json or a
safetensors file damaged."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
import torch

from stp.models import ModelConfig, build_reference
from stp.models.hf import HFCheckpoint, config_from_hf, save_state

CONFIG = ModelConfig(vocab_size=40, hidden=16, num_layers=4, num_heads=2, num_kv_heads=2,
                     ffn_hidden=32, max_seq_len=32, seed=1)


def make_hf(path: Path, config: ModelConfig = CONFIG) -> Path:
    model = build_reference(config, torch.float32)
    save_state(path, {n: p.detach() for n, p in model.named_parameters()}, config)
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf(tmp_path_factory.mktemp("hf") / "ok")


def _copy(good: Path, tmp: Path) -> Path:
    import shutil

    out = tmp / "c"
    shutil.copytree(good, out)
    return out


def _edit(path: Path, **fields: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(fields)
    (path / "config.json").write_text(json.dumps(raw))


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_the_good_checkpoint_opens(good: Path) -> None:
    assert HFCheckpoint.open(good).config.num_layers == 4


def test_a_billion_layers_is_refused_at_once_in_bounded_memory(good: Path, tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    _edit(ckpt, num_hidden_layers=1_000_000_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    assert time.perf_counter() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
    line = _one_line(e)
    assert "num_hidden_layers=1000000000" in line and "1..1024" in line
    assert line.count("config.json") == 1  # the file named once


def test_more_layers_than_the_weights_hold_names_both(good: Path, tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    _edit(ckpt, num_hidden_layers=900)
    with pytest.raises(ValueError, match=r"num_hidden_layers=900, but the weights hold 4"):
        HFCheckpoint.open(ckpt)


@pytest.mark.parametrize(("field", "value"), [
    ("hidden_size", 2**40), ("num_attention_heads", 10**6), ("num_key_value_heads", 0),
    ("vocab_size", 10**12), ("intermediate_size", -1), ("max_position_embeddings", 2**40),
    ("head_dim", 10**9), ("vocab_size", "40"), ("hidden_size", 1.5), ("num_hidden_layers", True),
    ("rms_norm_eps", float("nan")), ("rope_theta", 1e300), ("initializer_range", -1),
    ("rope_scaling", "big"), ("layer_types", 7), ("tie_word_embeddings", "yes"),
    ("pad_token_id", "0"),
])
def test_every_field_is_bounded(good: Path, tmp_path: Path, field: str, value: object) -> None:
    ckpt = _copy(good, tmp_path)
    _edit(ckpt, **{field: value})
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    assert field in _one_line(e)


def test_llama3_scaling_factors_are_bounded() -> None:
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 8,
           "rope_scaling": {"rope_type": "llama3", "factor": 1e300, "low_freq_factor": 1,
                            "high_freq_factor": 4, "original_max_position_embeddings": 8}}
    with pytest.raises(ValueError, match="factor=1e\\+300"):
        config_from_hf(raw)


@pytest.mark.parametrize("content", [b"[1, 2, 3]", b"\x00\x01\xff\xfe binary", b"{not json",
                                     b"", b'"a string"'])
def test_config_json_that_is_no_object_names_the_file(good: Path, tmp_path: Path,
                                                     content: bytes) -> None:
    ckpt = _copy(good, tmp_path)
    (ckpt / "config.json").write_bytes(content)
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    assert "config.json" in _one_line(e)


def _weights(ckpt: Path) -> Path:
    return next(ckpt.glob("*.safetensors"))


def test_truncated_safetensors_names_the_file(good: Path, tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    f = _weights(ckpt)
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    line = _one_line(e)
    assert f.name in line and "truncated" in line


def test_a_header_claiming_a_terabyte_is_refused_before_it_is_read(good: Path,
                                                                   tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    f = _weights(ckpt)
    data = f.read_bytes()
    f.write_bytes(int(1e12).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    line = _one_line(e)
    assert f.name in line and "1000000000000" in line


@pytest.mark.parametrize("cut", [0, 3, 8, 20])
def test_a_file_cut_inside_its_header_names_the_file(good: Path, tmp_path: Path, cut: int) -> None:
    ckpt = _copy(good, tmp_path)
    f = _weights(ckpt)
    f.write_bytes(f.read_bytes()[:cut])
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    assert f.name in _one_line(e)


def test_an_index_that_is_a_list_names_the_file(good: Path, tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    (ckpt / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    assert "model.safetensors.index.json" in _one_line(e)


def test_an_index_pointing_outside_the_directory_is_refused(good: Path, tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}))
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        HFCheckpoint.open(ckpt)


def test_an_index_naming_a_file_without_the_tensor_is_refused(good: Path,
                                                               tmp_path: Path) -> None:
    ckpt = _copy(good, tmp_path)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model.safetensors",
                        "model.norm.weight": "model.safetensors",
                        "model.layers.9.mlp.up_proj.weight": "model.safetensors"}}))
    with pytest.raises(ValueError) as e:
        HFCheckpoint.open(ckpt)
    assert _one_line(e).endswith("model.safetensors.index.json puts tensor "
                                 "model.layers.9.mlp.up_proj.weight in model.safetensors, "
                                 "which does not hold it")


def test_llama3_scaling_bands_in_the_wrong_order_name_the_file() -> None:
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 8,
           "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                            "high_freq_factor": 1, "original_max_position_embeddings": 8}}
    with pytest.raises(ValueError, match=r"^x/config.json: .*high_freq_factor"):
        config_from_hf(raw, "x/config.json")
