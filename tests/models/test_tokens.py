"""Tokenised data: documents joined with EOS, packed, cached by (tokenizer, data)."""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path

import _hf
import pytest
import torch
from tokenizers import Tokenizer

from stp.train.data.tokens import TokenBatches, TokenStream, eos_id, find_tokenizer, tokenize


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    d.mkdir()
    text = _hf.corpus_text(800)
    (d / "a.txt").write_text(text[:2500])
    (d / "b.txt").write_text(text[2500:])
    return d


def test_documents_are_joined_with_eos_and_cached(
    corpus: Path, checkpoints: dict[str, Path]
) -> None:
    tok_path = find_tokenizer(None, str(checkpoints["llama"]))
    assert tok_path == checkpoints["llama"] / "tokenizer.json"
    eos = eos_id(tok_path, json.loads((checkpoints["llama"] / "config.json").read_text()))
    assert eos == 2
    cache = tokenize(str(corpus), tok_path, eos)
    assert cache.parent == corpus.parent / ".docs.stp-tokens"  # next to the data
    tok = Tokenizer.from_file(str(tok_path))
    expected = [*tok.encode((corpus / "a.txt").read_text()).ids, eos,
                *tok.encode((corpus / "b.txt").read_text()).ids, eos]
    stream = TokenStream(cache)
    assert stream.read(0, stream.size).tolist() == expected
    # a second run reads the cache: same file, not rewritten
    stamp = cache.stat().st_mtime_ns
    os.utime(cache, ns=(stamp - 10**9, stamp - 10**9))
    assert tokenize(str(corpus), tok_path, eos) == cache
    assert cache.stat().st_mtime_ns == stamp - 10**9
    # other data or another tokenizer: another key
    (corpus / "b.txt").write_text("changed text")
    assert tokenize(str(corpus), tok_path, eos) != cache
    assert tokenize(str(corpus), checkpoints["qwen2"] / "tokenizer.json", eos).name != cache.name


def test_eos_from_tokenizer_config_when_config_has_none(checkpoints: dict[str, Path]) -> None:
    assert eos_id(checkpoints["qwen2"] / "tokenizer.json", None) == 2  # "</s>"


def test_batches_are_packed_sequences_fixed_by_seed_and_step(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(array("i", range(1000)).tobytes())  # the cache's format
    b = TokenBatches(TokenStream(path), seq_len=9, batch_size=4, seed=1)
    assert b.sequences == 100
    tokens, targets = b.batch(3)
    assert tokens.shape == targets.shape == (4, 9) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert torch.all(tokens[:, 0] % 10 == 0)  # each row starts a packed sequence
    again = TokenBatches(TokenStream(path), seq_len=9, batch_size=4, seed=1)
    assert torch.equal(again.batch(3)[0], tokens)
    epoch = torch.cat([b.batch(s)[0][:, 0] for s in range(25)])  # 25 x 4 = 100 rows
    assert sorted((epoch // 10).tolist()) == list(range(100))  # every sequence once


def test_a_missing_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        find_tokenizer(str(tmp_path), None)
    assert find_tokenizer(None, str(tmp_path)) is None  # no tokenizer: bytes
