"""`stp memory` and `stp train`'s pre-launch check price the multimodal model
(`--arch mllm`) as they price the decoder."""

import json

import pytest

from stp.cli.main import main

FLAGS = ["--arch", "mllm", "--layers", "2", "--hidden", "64", "--seq-len", "16"]


def test_a_multimodal_train_line_gets_an_estimate(capsys):
    assert main(["memory", *FLAGS, "--pp", "2", "--tp", "2", "--schedule", "stp"]) == 0
    out = capsys.readouterr().out
    assert "vision encoder of 2 blocks" in out and "peak: rank" in out
    assert main(["memory", *FLAGS, "--pp", "2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert len(est["ranks"]) == 2
    # stage 0 holds the encoder (patch and text embeddings, blocks, merger): not empty
    assert all(r["weights"] > 0 and r["activations_peak"] > 0 for r in est["ranks"])


@pytest.mark.parametrize("cmd", ["memory", "train"])
def test_a_budget_too_small_is_one_line_exit_2(cmd, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [cmd, *FLAGS, "--pp", "2", "--memory-budget", "1KB", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stp: error:") and "activations" in err[0]
