"""Data files come from elsewhere (stp.train.data): a truncated, oversized or edited
Megatron index, a wrong dtype code, a flat token file cut mid-id, ids outside the
model's vocabulary, malformed records and a missing optional extra are each one
ValueError line naming the file (and the offset or row), never a wrong read."""

from __future__ import annotations

import builtins
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from stp.train.data.load import DataOptions, open_data
from stp.train.data.megatron import MegatronTokens, MegatronWriter
from stp.train.data.records import iter_texts
from stp.train.data.token_file import FlatTokens

DOCS = [[5, 6, 7, 2], [8, 9, 2], [10, 11, 12, 13, 2]]


def _megatron(tmp_path: Path, docs=DOCS, dtype=np.uint16) -> Path:
    w = MegatronWriter(tmp_path / "m", dtype)
    for d in docs:
        w.add(d)
    return w.finish()


def _refused(match: str, prefix: Path, vocab: int | None = None) -> str:
    with pytest.raises(ValueError, match=match) as info:
        MegatronTokens(prefix, vocab)
    text = str(info.value)
    assert "\n" not in text and str(prefix) in text
    return text


def _patch(path: Path, offset: int, raw: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + len(raw)] = raw
    path.write_bytes(bytes(data))


def test_a_truncated_idx_is_refused(tmp_path):
    prefix = _megatron(tmp_path)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:-3])
    _refused(r"m\.idx: \d+ bytes, but its header .* needs \d+ \(truncated or damaged\)", prefix)
    idx.write_bytes(idx.read_bytes()[:20])
    _refused("shorter than the 34-byte MMIDIDX header", prefix)


def test_an_oversized_idx_and_a_header_claiming_huge_counts_are_refused(tmp_path):
    prefix = _megatron(tmp_path)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes() + b"\0" * 16)
    _refused("truncated or damaged", prefix)
    prefix = _megatron(tmp_path)
    _patch(Path(f"{prefix}.idx"), 18, struct.pack("<Q", 1 << 60))  # sequence count
    _refused("needs", prefix)


def test_sequence_modes_of_a_multimodal_dataset_are_refused(tmp_path):
    prefix = _megatron(tmp_path)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes() + b"\0" * len(DOCS))  # one int8 mode per sequence
    _refused("per-sequence modes", prefix)


@pytest.mark.parametrize(("code", "match"), [(6, "dtype code 6 is not a token id type"),
                                             (9, "dtype code 9 is not a token id type")])
def test_a_wrong_dtype_code_is_refused(tmp_path, code, match):
    prefix = _megatron(tmp_path)
    _patch(Path(f"{prefix}.idx"), 17, bytes([code]))
    _refused(match, prefix)


def test_bad_magic_and_version_are_refused(tmp_path):
    prefix = _megatron(tmp_path)
    _patch(Path(f"{prefix}.idx"), 9, struct.pack("<Q", 2))
    _refused("MMIDIDX version 2; stp reads version 1", prefix)
    _patch(Path(f"{prefix}.idx"), 0, b"NOTMAGIC!")
    _refused("no MMIDIDX magic", prefix)


def test_a_bin_shorter_or_longer_than_its_index_is_refused(tmp_path):
    prefix = _megatron(tmp_path)
    bin_ = Path(f"{prefix}.bin")
    bin_.write_bytes(bin_.read_bytes()[:-2])
    _refused(r"m\.bin: 22 bytes, but m\.idx describes 24", prefix)
    bin_.write_bytes(bin_.read_bytes() + b"\0" * 6)
    _refused("describes 24", prefix)


def test_edited_offsets_or_document_index_are_refused(tmp_path):
    prefix = _megatron(tmp_path)
    _patch(Path(f"{prefix}.idx"), 34 + 4 * 3 + 8, struct.pack("<q", 2))
    _refused("not the sequences back to back", prefix)
    prefix = _megatron(tmp_path)
    _patch(Path(f"{prefix}.idx"), 34 + 12 * 3 + 8 * 3, struct.pack("<q", 7))
    _refused("document index does not run from 0 to the sequence count", prefix)


def test_a_megatron_id_outside_the_vocabulary_is_refused_naming_file_and_offset(tmp_path):
    prefix = _megatron(tmp_path, [[5, 6, 2], [8, 300, 2]])
    text = _refused(r"token id 300 at token offset 4 is outside the model's vocabulary "
                    "of 256", prefix, vocab=256)
    assert "m.bin" in text
    MegatronTokens(prefix, 301)  # inside a larger vocabulary


def test_a_flat_token_file_cut_mid_id_or_with_an_id_outside_the_vocabulary(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(np.asarray([1, 2, 3], np.uint16).tobytes() + b"\x01")
    with pytest.raises(ValueError, match=r"train\.bin: 7 bytes, not a whole number of uint16"):
        FlatTokens(path)
    path.write_bytes(np.asarray([1, 2, 999, 3], np.uint32).tobytes())
    with pytest.raises(ValueError, match=r"train\.bin: token id 999 at token offset 2 is "
                       "outside the model's vocabulary of 100"):
        FlatTokens(path, "uint32", vocab=100)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        FlatTokens(path)


def test_malformed_jsonl_a_missing_column_and_non_text_values_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text" "no colon"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: cannot read it as jsonl \(JSON parse"):
        list(iter_texts(bad, "jsonl", "text"))
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"no column 'text' \(it has body\); name the text "
                       "column with --data-column"):
        list(iter_texts(other, "jsonl", "text"))
    nums = tmp_path / "nums.jsonl"
    nums.write_text('{"text": 1}\n{"text": 2}\n')
    with pytest.raises(ValueError, match=r"nums\.jsonl: row 0: column 'text' holds a int"):
        list(iter_texts(nums, "jsonl", "text"))


def test_a_damaged_parquet_file_is_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really a parquet file")
    with pytest.raises(ValueError, match=r"bad\.parquet: cannot read it as parquet"):
        list(iter_texts(bad, "parquet", "text"))


def test_without_the_data_extra_records_name_the_extra(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_pyarrow(name, *a, **kw):
        if name.startswith(("pyarrow", "datasets")):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match=r"needs the optional extra stp\[data\].*pip install "
                       r"'stp\[data\]'"):
        list(iter_texts(path, "jsonl", "text"))


def test_record_data_without_a_tokenizer_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match="is jsonl text; give --tokenizer PATH"):
        open_data(DataOptions(str(path)), None, 256, 4, 1, 0)
