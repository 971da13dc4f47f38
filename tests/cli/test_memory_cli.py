"""`stp memory`, and --memory-budget / --recompute on simulate and search."""

import json

import pytest

from stp.cli.main import main

QWEN = ["--model", "qwen2-12.1b", "--pp", "2", "--tp", "8", "-m", "8", "--seq-len", "6144"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_names_the_peak_rank_and_its_categories(capsys):
    out = _json(capsys, ["memory", *QWEN, "--json"])
    assert set(out["memory"]) == {"weights", "grads", "masters", "optimizer",
                                  "activations_peak", "buffers", "total"}
    peak = max(out["ranks"], key=lambda r: r["total"])
    assert out["peak_rank"] == peak["rank"] and out["memory"]["total"] == peak["total"]
    assert out["memory"]["total"] == pytest.approx(
        sum(v for k, v in out["memory"].items() if k != "total"))


def test_features_move_the_right_categories(capsys):
    base = _json(capsys, ["memory", *QWEN, "--dp", "4", "--json"])["ranks"][0]
    sp = _json(capsys, ["memory", *QWEN, "--dp", "4", "--sequence-parallel", "--json"])
    shard = _json(capsys, ["memory", *QWEN, "--dp", "4", "--shard-optimizer", "--json"])
    assert sp["ranks"][0]["activations_peak"] < base["activations_peak"]
    assert shard["ranks"][0]["optimizer"] == base["optimizer"] / 4
    fp32 = _json(capsys, ["memory", *QWEN, "--dtype", "float32", "--json"])
    assert fp32["memory"]["masters"] == 0


def test_budget_refused_in_one_line(capsys):
    total = _json(capsys, ["memory", *QWEN, "--json"])["memory"]["total"]
    assert main(["memory", *QWEN, "--memory-budget", str(int(total))]) == 0
    capsys.readouterr()
    assert main(["memory", *QWEN, "--memory-budget", str(int(total) - 1)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "largest: activations_peak" in err[0]


def test_config_json(tmp_path, capsys):
    cfg = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = _json(capsys, ["memory", "--model", str(path), "--pp", "2", "--tp", "2", "--json"])
    assert len(out["ranks"]) == 2
    assert main(["memory", "--model", str(tmp_path)]) == 0  # a directory holding one
    capsys.readouterr()
    path.write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    assert main(["memory", "--model", str(path)]) == 2


@pytest.mark.parametrize("argv", [
    ["memory", "--model", "nope"],
    ["memory", "--model", "qwen2-12.1b", "--pp", "65"],
    ["memory", "--model", "qwen2-12.1b", "--recompute", "some"],
    ["memory", "--model", "qwen2-12.1b", "--memory-budget", "80XB"],
    ["memory", "--model", "qwen2-12.1b", "--schedule", "nope"],
    ["memory", "--model", "qwen2-12.1b", "--tp", "3"],
    ["memory", "--model", "mllm-qwen2vl-7b"],
    ["simulate", "--schedule", "stp", "--pp", "2", "-m", "4", "--memory-budget", "1GB"],
    ["simulate", "--schedule", "stp", "--pp", "2", "-m", "4", "--recompute", "full"],
])
def test_bad_input_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stp: error:")


def test_simulate_budget_and_recompute(capsys):
    argv = ["simulate", "--schedule", "stp", "--pp", "2", "-m", "8", "--model",
            "qwen2-12.1b,sequence=6144", "--hardware", "a800-80g"]
    assert main([*argv, "--memory-budget", "80GiB"]) == 0
    capsys.readouterr()
    assert main([*argv, "--memory-budget", "20GiB"]) == 2
    assert "activations_peak" in capsys.readouterr().err
    plain = _json(capsys, [*argv, "--json"])["makespan"]
    full = _json(capsys, [*argv, "--recompute", "full", "--json"])["makespan"]
    assert full > plain


def test_search_recompute_auto_reports_the_choice(capsys):
    assert main(["search", "--pp", "2", "-m", "4", "--model",
                 "zb-1.5b,layers=4,vocab=1000", "--memory-limit", "0.9",
                 "--recompute", "auto", "--time-limit", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recompute_tried"]["none"] is None
    assert len(out["recompute"]) == 4 and set(out["recompute"]) != {"none"}
    assert max(out["peak_activation"]) <= 0.9 + 1e-9


def test_search_takes_its_limit_from_a_byte_budget(capsys):
    argv = ["search", "--pp", "2", "-m", "4", "--model", "zb-1.5b,layers=4,vocab=1000",
            "--time-limit", "1", "--json"]
    out = _json(capsys, [*argv, "--memory-budget", "40GiB"])
    assert out["memory_limit"] > 0 and max(out["peak_activation"]) <= out["memory_limit"]
    assert main([*argv, "--memory-budget", "1MiB"]) == 2
    assert "model states" in capsys.readouterr().err
    assert main(argv) == 2  # neither a limit nor a budget
    assert "--memory-limit" in capsys.readouterr().err
