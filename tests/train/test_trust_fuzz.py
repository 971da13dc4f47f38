"""Fuzz, in-process and bounded: hostile config.json fields and damaged checkpoint files
never end in a traceback, a hang, unbounded memory or a silently different model.

Every outcome must be either a one-line ValueError or acceptance; an accepted
damaged checkpoint must load the very model that was saved (in practice every
change to a file the manifest lists is refused by its checksum)."""

from __future__ import annotations

import functools
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stp.models import ModelConfig, build_reference
from stp.models.hf import HFCheckpoint, config_from_hf, save_state
from stp.train.checkpoint import checks
from stp.train.checkpoint.read import read_metadata
from stp.train.step.trainer import Trainer

CONFIG = ModelConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=2, num_kv_heads=2,
                     ffn_hidden=32, max_seq_len=16, seed=5)
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
SECONDS = 10.0
"""No example may take longer (a hang or a huge allocation shows up as time)."""
RSS_GROWTH_KIB = 300_000
"""Nor grow the process by more than this (a 1e9-layer config grew it by 21 GB)."""


def _bounded(fn):
    """Run fn(); assert the time and memory bounds; return its ValueError text or None."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        fn()
        error = None
    except ValueError as e:  # the only failure allowed: stp's one-line refusal
        error = str(e)
        assert "\n" not in error and "Traceback" not in error and error
        assert "weights_only" not in error
    assert time.perf_counter() - start < SECONDS
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < RSS_GROWTH_KIB
    return error


# -- config.json ------------------------------------------------------------------------

@functools.cache
def hf_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="stp-fuzz-hf-"))
    model = build_reference(CONFIG, torch.float32)
    save_state(root, {n: p.detach() for n, p in model.named_parameters()}, CONFIG)
    return root


FIELDS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "intermediate_size", "max_position_embeddings", "head_dim",
          "rope_theta", "rms_norm_eps", "initializer_range", "tie_word_embeddings",
          "pad_token_id", "rope_scaling", "rope_parameters", "model_type", "layer_types",
          "hidden_act", "num_local_experts", "quantization_config"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.sampled_from([0, 1, 2, 4, 16, 1024, 1025, 10**9, 2**31, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings", "rope_theta", "x"]),
        inner, max_size=5),
    max_leaves=8)


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, min_size=1, max_size=4))
def test_config_fields_never_crash(edits: dict) -> None:
    raw = json.loads((hf_dir() / "config.json").read_text())
    raw.update(edits)
    _bounded(lambda: config_from_hf(raw, "config.json"))
    tmp = Path(tempfile.mkdtemp(prefix="stp-fuzz-cfg-"))
    try:
        for f in hf_dir().iterdir():
            (tmp / f.name).symlink_to(f)
        (tmp / "config.json").unlink()
        text = json.dumps(raw, allow_nan=True)
        (tmp / "config.json").write_text(text)
        error = _bounded(lambda: HFCheckpoint.open(tmp))
        if error is None:  # accepted: it must describe the very weights in the files
            assert HFCheckpoint.open(tmp).config.num_layers == CONFIG.num_layers
    finally:
        shutil.rmtree(tmp)


@FUZZ
@given(st.binary(max_size=300))
def test_config_json_bytes_never_crash(data: bytes) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stp-fuzz-raw-"))
    try:
        for f in hf_dir().iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f)
        (tmp / "config.json").write_bytes(data)
        assert _bounded(lambda: HFCheckpoint.open(tmp)) is not None
    finally:
        shutil.rmtree(tmp)


@FUZZ
@given(st.integers(min_value=0, max_value=2**64 - 1), st.integers(min_value=0, max_value=400))
def test_safetensors_headers_never_crash(length: int, cut: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stp-fuzz-st-"))
    try:
        for f in hf_dir().iterdir():
            shutil.copy(f, tmp / f.name)
        w = next(tmp.glob("*.safetensors"))
        data = w.read_bytes()
        w.write_bytes(length.to_bytes(8, "little") + data[8:8 + cut])
        assert _bounded(lambda: HFCheckpoint.open(tmp)) is not None
    finally:
        shutil.rmtree(tmp)


# -- sharded checkpoint files --------------------------------------------------------------

@functools.cache
def saved_step() -> tuple[Path, dict[str, torch.Tensor]]:
    """A two-step checkpoint directory and the model it holds at step 2."""
    root = Path(tempfile.mkdtemp(prefix="stp-fuzz-ckpt-"))
    trainer = Trainer(CONFIG, None, "1f1b", pp=1, microbatches=2)
    for step in range(2):
        tok = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(step))
        trainer.step((tok[:, :-1], tok[:, 1:]))
        trainer.save(str(root))
    model = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return root / "step-00000002", model


def _loads_the_saved_model(step: Path, model: dict[str, torch.Tensor]) -> None:
    again = Trainer.resume(str(step), CONFIG, None, "1f1b", pp=1, microbatches=2)
    for n, p in again.named_parameters():
        assert torch.equal(p.detach(), model[n]), f"{n} differs: a silently different model"


FILES = [".metadata", "__0_0.distcp", "stp.json", "stp.sha256.json"]
damage = st.one_of(
    st.tuples(st.just("flip"), st.sampled_from(FILES), st.floats(0, 1, exclude_max=True),
              st.integers(0, 7)),
    st.tuples(st.just("cut"), st.sampled_from(FILES), st.floats(0, 1, exclude_max=True),
              st.just(0)),
    st.tuples(st.just("delete"), st.sampled_from(FILES), st.just(0.0), st.just(0)),
)


@FUZZ
@given(st.lists(damage, min_size=1, max_size=3))
def test_damaged_checkpoints_are_refused_or_load_the_saved_model(damages: list) -> None:
    step, model = saved_step()
    tmp = Path(tempfile.mkdtemp(prefix="stp-fuzz-step-")) / step.name
    try:
        shutil.copytree(step, tmp)
        for kind, name, where, bit in damages:
            f = tmp / name
            if not f.exists():
                continue
            data = bytearray(f.read_bytes())
            if kind == "delete":
                f.unlink()
            elif kind == "cut":
                f.write_bytes(bytes(data[:int(where * len(data))]))
            elif data:
                data[int(where * len(data))] ^= 1 << bit
                f.write_bytes(bytes(data))
        error = _bounded(lambda: checks.check_resume(tmp, None))
        if error is None:
            _loads_the_saved_model(tmp, model)
    finally:
        shutil.rmtree(tmp.parent)


@FUZZ
@given(st.binary(max_size=400))
def test_metadata_bytes_never_crash(data: bytes) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stp-fuzz-md-"))
    try:
        (tmp / ".metadata").write_bytes(data)
        assert _bounded(lambda: read_metadata(tmp)) is not None
    finally:
        shutil.rmtree(tmp)


@pytest.mark.parametrize("trial", range(3))
def test_a_pickle_built_from_allowed_pieces_stays_bounded(trial: int) -> None:
    """Real metadata with random bytes spliced in: refused or a Metadata, nothing else."""
    step, _ = saved_step()
    good = (step / ".metadata").read_bytes()
    gen = torch.Generator().manual_seed(trial)
    tmp = Path(tempfile.mkdtemp(prefix="stp-fuzz-splice-"))
    try:
        for _ in range(40):
            data = bytearray(good)
            at = int(torch.randint(0, len(data), (1,), generator=gen))
            data[at] = int(torch.randint(0, 256, (1,), generator=gen))
            (tmp / ".metadata").write_bytes(bytes(data))
            _bounded(lambda: read_metadata(tmp))
    finally:
        shutil.rmtree(tmp)
