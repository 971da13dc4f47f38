"""`--data` in the formats users have (stp.train.data): each detection rule, each
format's ids (a 3-row file gives the tokenizer's ids + EOS per row), the Megatron
files byte for byte as Megatron-LM's own writer makes them, and `stp data
prepare`'s parallel tokenisation equal to the serial one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from stp.train.data.detect import detect_format, parse_mixture
from stp.train.data.load import DataOptions, open_data
from stp.train.data.megatron import MegatronTokens
from stp.train.data.prepare import histogram, prepare
from stp.train.data.token_file import FlatTokens
from stp.train.data.tokens import Tokenizer, eos_id

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from _hf import corpus_text, save_tokenizer  # noqa: E402

ROWS = ["pipeline tensor stage rank.", "braid schedule forward backward weight gradient.",
        "all-reduce microbatch bubble."]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d, corpus_text())
    return Tokenizer(d / "tokenizer.json", eos_id(d / "tokenizer.json"))


def expected_ids(tok: Tokenizer, rows: list[str] = ROWS) -> list[list[int]]:
    hf = HFTokenizer.from_file(str(tok.path))
    return [[*hf.encode(r).ids, tok.eos] for r in rows]


def stream_of(path: str, tok: Tokenizer | None, **opts) -> list[int]:
    opened = open_data(DataOptions(path, **opts), tok, 96, 4, 1, 0)
    src = opened.batches.stream
    return src.read(0, src.size).tolist()


def write_jsonl(path: Path, rows: list[str | None], column: str = "text") -> Path:
    path.write_text("".join(json.dumps({column: r, "id": i}) + "\n" for i, r in enumerate(rows)))
    return path


def write_megatron(prefix: Path, tok: Tokenizer, rows: list[str] = ROWS) -> Path:
    prepare(iter(rows), tok.path, tok.eos, 96, prefix)
    return prefix


# --- detection: one test per rule ------------------------------------------------


def test_a_prefix_with_idx_and_bin_beside_it_is_megatron(tmp_path, tok):
    prefix = write_megatron(tmp_path / "corpus_text_document", tok)
    assert detect_format(str(prefix)) == "megatron"
    assert detect_format(f"{prefix}.bin") == "megatron"


def test_another_bin_file_is_a_flat_token_file(tmp_path):
    (tmp_path / "train.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    assert detect_format(str(tmp_path / "train.bin")) == "tokens"


def test_jsonl_and_parquet_files_by_suffix(tmp_path):
    assert detect_format(str(write_jsonl(tmp_path / "a.jsonl", ROWS))) == "jsonl"
    (tmp_path / "b.parquet").write_bytes(b"PAR1")
    assert detect_format(str(tmp_path / "b.parquet")) == "parquet"


def test_a_jsonl_whose_first_row_has_messages_is_chat(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert detect_format(str(p)) == "chat"


def test_a_save_to_disk_directory_is_hf(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(str(tmp_path / "ds"))
    assert detect_format(str(tmp_path / "ds")) == "hf"


def test_anything_else_is_text_and_the_override_wins(tmp_path):
    (tmp_path / "notes.txt").write_text("plain text")
    (tmp_path / "dir").mkdir()
    assert detect_format(str(tmp_path / "notes.txt")) == "text"
    assert detect_format(str(tmp_path / "dir")) == "text"
    (tmp_path / "x.bin").write_text("text despite the suffix")
    assert detect_format(str(tmp_path / "x.bin"), "text") == "text"
    with pytest.raises(ValueError, match=r"--data-format 'csv': choose one of megatron"):
        detect_format(str(tmp_path / "notes.txt"), "csv")
    with pytest.raises(ValueError, match="--data-format megatron: no .*idx and .bin pair"):
        detect_format(str(tmp_path / "notes.txt"), "megatron")
    with pytest.raises(ValueError, match="does not exist"):
        detect_format(str(tmp_path / "missing"))


def test_mixture_specs_are_normalised_and_a_plain_path_is_one_source(tmp_path):
    assert parse_mixture("0.7:a,0.3:b") == [(0.7, "a"), (0.3, "b")]
    assert parse_mixture("2:a,6:b") == [(0.25, "a"), (0.75, "b")]
    assert parse_mixture("data/train.bin") == [(1.0, "data/train.bin")]
    odd = tmp_path / "1:x,2:y"  # an existing path is taken as it is
    odd.write_text("t")
    assert parse_mixture(str(odd)) == [(1.0, str(odd))]
    with pytest.raises(ValueError, match="'b' has no weight"):
        parse_mixture("0.5:a,b")
    with pytest.raises(ValueError, match="weight 0 of 'b' must be above 0"):
        parse_mixture("1:a,0:b")


# --- each format: the ids of a 3-row file are the tokenizer's + EOS ---------------


def test_jsonl_rows_are_the_tokenizers_ids_each_with_eos(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert stream_of(str(path), tok) == sum(expected_ids(tok), [])


def test_jsonl_skips_and_counts_null_and_empty_rows_and_reads_another_column(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], None, "", ROWS[1], ROWS[2]], "body")
    opened = open_data(DataOptions(str(path), column="body"), tok, 96, 4, 1, 0)
    assert opened.summaries[0][1].skipped == 2 and opened.summaries[0][1].documents == 3
    assert stream_of(str(path), tok, column="body") == sum(expected_ids(tok), [])
    assert "jsonl" in opened.line() and "3 documents" in opened.line()
    assert "2 skipped" in opened.line()


def test_parquet_rows_are_the_tokenizers_ids_each_with_eos(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ROWS}), tmp_path / "d.parquet")
    assert stream_of(str(tmp_path / "d.parquet"), tok) == sum(expected_ids(tok), [])


def test_save_to_disk_rows_are_the_tokenizers_ids_each_with_eos(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(str(tmp_path / "ds"))
    assert stream_of(str(tmp_path / "ds"), tok) == sum(expected_ids(tok), [])


def test_megatron_documents_are_the_tokenizers_ids_each_with_eos(tmp_path, tok):
    prefix = write_megatron(tmp_path / "m", tok)
    source = MegatronTokens(prefix, 96)
    assert source.documents == 3 and list(source.lengths) == [len(i) for i in expected_ids(tok)]
    assert stream_of(str(prefix), None) == sum(expected_ids(tok), [])


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_flat_token_file_is_read_in_its_dtype_and_counts_documents_by_eos(tmp_path, tok,
                                                                           dtype):
    ids = sum(expected_ids(tok), [])
    (tmp_path / "train.bin").write_bytes(np.asarray(ids, dtype=dtype).tobytes())
    flat = FlatTokens(tmp_path / "train.bin", dtype, eos=tok.eos, vocab=96)
    assert flat.documents == 3
    assert stream_of(str(tmp_path / "train.bin"), tok, token_dtype=dtype) == ids
    assert FlatTokens(tmp_path / "train.bin", dtype, eos=ids[0]).documents == ids.count(ids[0])


def test_megatron_files_equal_megatron_lms_own_writer_byte_for_byte(tmp_path, tok):
    """Reader and writer cannot share one misreading: Megatron-LM's
    IndexedDatasetBuilder writes the same .idx and .bin as stp's writer, and stp
    reads the builder's files as the tokenizer's ids."""
    pytest.importorskip("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    ids = expected_ids(tok)
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for doc in ids:
        builder.add_item(__import__("torch").tensor(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    write_megatron(tmp_path / "ours", tok)
    for suffix in (".idx", ".bin"):
        theirs = (tmp_path / f"theirs{suffix}").read_bytes()
        assert (tmp_path / f"ours{suffix}").read_bytes() == theirs, suffix
    assert stream_of(str(tmp_path / "theirs"), None) == sum(ids, [])


# --- stp data prepare ---------------------------------------------------------------


def test_parallel_tokenisation_writes_exactly_the_serial_files(tmp_path, tok):
    """More documents than one worker's chunk, so the order of chunks matters."""
    words = corpus_text(3000, seed=5).split(".")
    docs = [w.strip() or None for w in words] * 3
    serial = prepare(iter(docs), tok.path, tok.eos, 96, tmp_path / "serial")
    parallel = prepare(iter(docs), tok.path, tok.eos, 96, tmp_path / "parallel", workers=2)
    assert (serial.documents, serial.tokens, serial.skipped) == \
        (parallel.documents, parallel.tokens, parallel.skipped)
    assert serial.documents > 256 * 2
    for suffix in (".idx", ".bin", ".hist.json"):
        assert (tmp_path / f"serial{suffix}").read_bytes() == \
            (tmp_path / f"parallel{suffix}").read_bytes(), suffix
    hist = json.loads((tmp_path / "serial.hist.json").read_text())
    assert sum(b["count"] for b in hist["lengths"]) == serial.documents
    assert hist["mean_length"] == serial.tokens / serial.documents


def test_the_length_histogram_bins_are_powers_of_two_inclusive():
    assert histogram([1, 2, 3, 4, 5, 8, 9]) == [
        {"upto": 1, "count": 1}, {"upto": 2, "count": 1}, {"upto": 4, "count": 2},
        {"upto": 8, "count": 2}, {"upto": 16, "count": 1}]


def test_stp_data_prepare_reads_several_inputs_and_refuses_in_one_line(tmp_path, tok, capsys):
    from stp.cli.main import main

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(ROWS[0])
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS[1:])
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(tmp_path / "texts"), str(jsonl), "--tokenizer",
                 str(tok.path), "--out", str(out)]) == 0
    tokens = sum(len(i) for i in expected_ids(tok))
    assert f"3 documents, {tokens} tokens, 0 skipped" in capsys.readouterr().out
    assert MegatronTokens(out).read(0, tokens).tolist() == sum(expected_ids(tok), [])
    for argv, line in (
        ([str(out)], "is megatron data; stp data prepare takes text, JSONL"),
        ([str(jsonl), "--workers", "0"], "--workers 0: give 1 to 1024"),
        ([str(tmp_path / "missing.jsonl")], "does not exist"),
        ([str(jsonl), "--data-column", "body"], "no column 'body'"),
    ):
        assert main(["data", "prepare", *argv, "--tokenizer", str(tok.path),
                     "--out", str(tmp_path / "again")]) == 2
        err = capsys.readouterr().err
        assert line in err and len(err.strip().splitlines()) == 1, err
