"""Tiny random Llama and Qwen2 checkpoints (float64, built with transformers, saved
once per session under a temporary directory; nothing is downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))  # _dist

import _hf  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"llama": dir, "qwen2": dir}, each with a tokenizer trained on `corpus_text`."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, kind in enumerate(("llama", "qwen2")):
        out[kind] = root / kind
        out[kind].mkdir()
        _hf.build(kind, out[kind], seed=i)
        _hf.save_tokenizer(out[kind], _hf.corpus_text())
    return out
