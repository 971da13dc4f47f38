"""Document masking in the cost model: attention priced over the mean document
(`ModelSpec.mean_doc_len`, `stp plan --mean-doc-len N|PREFIX`), against a hand
count of the FLOPs."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from stp.cli.common import mean_doc_len
from stp.cli.main import main
from stp.costmodel import parse_model
from stp.costmodel.decoder.spec import ModelSpec, layer_flops

SPEC = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, sequence=1024,
                 micro_batch=2)


def test_attention_flops_fall_by_the_mean_document_over_the_sequence() -> None:
    s, b, h = 1024, 2, 64
    linear = 2 * s * b * (h * (h + 2 * 32) + h * h + 3 * h * 128)  # kv dims 2 x 16
    assert layer_flops(SPEC) == (linear + 4 * s * s * b * h, linear + 8 * s * s * b * h, linear)
    masked = replace(SPEC, mean_doc_len=128)
    assert layer_flops(masked) == (linear + 4 * s * 128 * b * h, linear + 8 * s * 128 * b * h,
                                   linear)
    assert layer_flops(replace(SPEC, mean_doc_len=5000)) == layer_flops(SPEC)  # at most s


def test_mean_doc_len_is_checked_and_parsed() -> None:
    with pytest.raises(ValueError, match="--mean-doc-len 0 must be an integer >= 1"):
        replace(SPEC, mean_doc_len=0)
    assert parse_model("qwen2-12.1b,mean_doc_len=512").mean_doc_len == 512


def test_the_flag_takes_a_count_or_a_prepared_dataset(tmp_path: Path) -> None:
    assert mean_doc_len("300") == 300
    (tmp_path / "d.hist.json").write_text(json.dumps({"mean_length": 211.6, "documents": 5}))
    assert mean_doc_len(str(tmp_path / "d")) == 212
    assert mean_doc_len(str(tmp_path / "d.hist.json")) == 212
    (tmp_path / "e.hist.json").write_text(json.dumps({"documents": 5}))
    for bad, message in (("0", "give tokens per document >= 1"),
                         (str(tmp_path / "missing"), "neither a token count nor a dataset"),
                         (str(tmp_path / "e"), "no mean_length >= 1")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            mean_doc_len(bad)


def _best_step(extra: list[str], capsys: pytest.CaptureFixture) -> float:
    argv = ["plan", "--model", "qwen2-12.1b", "--gpus", "16", "--global-batch", "64",
            "--seq-len", "8192", "--top", "1", "--schedules", "1f1b", "--partition", "even",
            "--json", *extra]
    assert main(argv) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    return plans[0]["step_time_s"]


def test_plan_prices_masked_attention_faster(capsys: pytest.CaptureFixture) -> None:
    full = _best_step([], capsys)
    masked = _best_step(["--mean-doc-len", "512"], capsys)
    assert masked < full  # 8192-token rows of 512-token documents: 1/16 of the scores


def test_memory_prices_the_step_with_it_and_keeps_the_bytes(capsys: pytest.CaptureFixture,
                                                             tmp_path: Path) -> None:
    def run(extra: list[str]) -> dict:
        argv = ["memory", "--model", "qwen2-12.1b", "--pp", "4", "--tp", "8", "-m", "8",
                "--json", *extra]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    full, masked = run([]), run(["--mean-doc-len", "512"])
    assert masked["memory"] == full["memory"]  # the bytes do not change
    assert masked["step_ms"] < full["step_ms"]


def test_a_train_line_with_document_masking_reads_the_prepared_histogram(
        tmp_path: Path) -> None:
    from types import SimpleNamespace

    from stp.cli.memory import _documents

    (tmp_path / "d.hist.json").write_text(json.dumps({"mean_length": 99.0}))
    job = SimpleNamespace(document_mask=True, data=str(tmp_path / "d"))
    assert _documents(argparse.Namespace(mean_doc_len=None), job) == 99
    assert _documents(argparse.Namespace(mean_doc_len=7), job) == 7  # the flag wins
    off = SimpleNamespace(document_mask=False, data=str(tmp_path / "d"))
    assert _documents(argparse.Namespace(mean_doc_len=None), off) is None
    bare = SimpleNamespace(document_mask=True, data=str(tmp_path / "none"))
    assert _documents(argparse.Namespace(mean_doc_len=None), bare) is None
