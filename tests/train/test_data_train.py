"""`stp train` on data as users prepare it (stp.train.data): the same documents as
JSONL, as a Megatron dataset (`stp data prepare`) and as a flat token file give
identical losses (float64, a tiny transformers Llama and a tokenizer trained
here); a mixture resumed on another mesh continues with the uninterrupted run's
batches; a resume on other data is refused in one line unless --data-changed-ok."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from stp.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from _hf import build, corpus_text, save_tokenizer  # noqa: E402

FLAGS = ["--pp", "1", "--seq-len", "16", "--microbatch-size", "1", "-m", "2",
         "--dtype", "float64", "--timeout", "60"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data_train")
    ckpt = root / "llama"
    build("llama", ckpt)
    save_tokenizer(ckpt, corpus_text())
    docs = [s.strip() for s in corpus_text(1500, seed=3).split(".") if s.strip()]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    hf = HFTokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = [i for d in docs for i in [*hf.encode(d).ids, 2]]  # config.json's eos_token_id 2
    (root / "train.bin").write_bytes(np.asarray(ids, np.uint16).tobytes())
    other = [s.strip() for s in corpus_text(800, seed=9).split(".") if s.strip()]
    (root / "other.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in other))
    assert main(["data", "prepare", str(root / "docs.jsonl"), "--tokenizer", str(ckpt),
                 "--out", str(root / "docs")]) == 0
    return {"root": root, "ckpt": ckpt}


def _losses(capfd, *argv: str) -> tuple[list[float], str]:
    code = main(["train", *FLAGS, "--json", *argv])
    got = capfd.readouterr()
    assert code == 0, got.err
    return [r["loss"] for r in map(json.loads, got.out.splitlines()) if "loss" in r], got.err


def test_jsonl_megatron_and_a_flat_token_file_train_to_identical_losses(setup, capfd):
    root, ckpt = setup["root"], setup["ckpt"]
    base = ["--init-from", str(ckpt), "--steps", "3"]
    runs = {}
    for name, data in (("jsonl", root / "docs.jsonl"), ("megatron", root / "docs"),
                       ("tokens", root / "train.bin")):
        runs[name], err = _losses(capfd, *base, "--data", str(data),
                                  "--out", str(root / f"out-{name}"))
        assert f"data: {name} {data}: " in err and " 0 skipped" in err, err
    assert len(runs["jsonl"]) == 3
    assert runs["jsonl"] == runs["megatron"] == runs["tokens"], runs


def test_a_resumed_mixture_on_another_mesh_continues_the_uninterrupted_batches(setup, capfd):
    root, ckpt = setup["root"], setup["ckpt"]
    mix = f"0.7:{root / 'docs'},0.3:{root / 'other.jsonl'}"
    base = ["--init-from", str(ckpt), "--data", mix]
    whole, err = _losses(capfd, *base, "--steps", "4", "--out", str(root / "whole"))
    assert "data: mixture of 0.7 x megatron" in err and "0.3 x jsonl" in err
    _losses(capfd, *base, "--steps", "2", "--out", str(root / "part"))
    code = main(["train", *FLAGS, "--pp", "2", "--json", *base, "--steps", "4",
                 "--resume", str(root / "part")])
    got = capfd.readouterr()
    assert code == 0, got.err
    resumed = [r["loss"] for r in map(json.loads, got.out.splitlines()) if "loss" in r]
    assert resumed == pytest.approx(whole[2:], rel=1e-10, abs=1e-12)


def test_a_resume_on_other_data_is_refused_unless_data_changed_ok(setup, capfd):
    root, ckpt = setup["root"], setup["ckpt"]
    out = root / "changed"
    _losses(capfd, "--init-from", str(ckpt), "--data", str(root / "docs"), "--steps", "1",
            "--out", str(out))
    code = main(["train", *FLAGS, "--data", str(root / "other.jsonl"), "--steps", "2",
                 "--resume", str(out)])
    err = capfd.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "is not the data the run being resumed trained on" in err
    assert "--data-changed-ok" in err
    losses, _ = _losses(capfd, "--data", str(root / "other.jsonl"), "--steps", "2",
                        "--resume", str(out), "--data-changed-ok")
    assert len(losses) == 1
