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


# -- a `stp train` command line --------------------------------------------------------

TRAIN = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "32"]


def _train_run_estimate(argv):
    """The estimate `stp train ARGV` checks against --memory-budget before launching."""
    from stp.cli.flags import from_args
    from stp.cli.main import build_parser
    from stp.train.run.config import TrainJob
    from stp.train.run.job import check
    from stp.train.run.memory_check import run_estimate

    job = from_args(TrainJob, build_parser().parse_args(["train", *argv]))
    return run_estimate(check(job))


@pytest.mark.parametrize("flags", [
    [],
    ["--pp", "2", "--tp", "2", "--schedule", "zb-v", "--sequence-parallel", "--dtype",
     "bfloat16", "-m", "6"],
    ["--pp", "2", "--dp", "2", "--schedule", "1f1b", "--offload", "all", "--partition", "1,3",
     "--microbatch-size", "2", "--lr", "0.1", "--steps", "7"],
])
def test_a_train_command_line_gets_the_estimate_train_checks(flags, capsys, tmp_path,
                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [*TRAIN, *flags, "--out", str(tmp_path / "out")]
    out = _json(capsys, ["memory", *argv, "--json"])
    assert list(tmp_path.iterdir()) == []  # no --out, no runs/ directory: nothing written
    want = _train_run_estimate(argv).to_json()  # train's check creates --out
    assert {k: out[k] for k in want} == json.loads(json.dumps(want))


def test_train_mode_takes_train_defaults(capsys):
    out = _json(capsys, ["memory", "--json"])  # stp train's toy model, float32, 4 x 64
    assert out["memory"]["masters"] == 0  # float32: the weights are the masters
    assert out["memory"]["weights"] == out["memory"]["grads"]
    capsys.readouterr()
    assert main(["memory", "--pp", "2", "--hidden", "64"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "microbatch 4 x 64 tokens" in head and "float32" in head and "m=8" in head


def test_init_from_reads_config_json_only(tmp_path, capsys):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights at all
    out = _json(capsys, ["memory", "--init-from", str(tmp_path), "--pp", "2", "--json"])
    assert len(out["ranks"]) == 2 and out["memory"]["total"] > 0
    assert main(["memory", "--init-from", str(tmp_path), "--layers", "8"]) == 2
    assert "--layers 8 contradicts" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["memory", "--model", "qwen2-12.1b", "--layers", "3"],
    ["memory", "--emulate-compute", "f=1,b=1,w=1"],
    ["memory", "--dtype", "float16"],
    ["memory", "--tp", "3"],
    ["memory", "--pp", "2", "--schedule", "nope"],
    ["memory", "--init-from", "/nonexistent/dir"],
    ["memory", "--steps", "0"],
])
def test_train_mode_bad_input_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stp: error:")


def test_a_schedule_file_is_priced_as_its_schedule(tmp_path, capsys):
    path = tmp_path / "zbv.json"
    assert main(["export", "--schedule", "zb-v", "--pp", "2", "-m", "8", "--format", "json",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    by_file = _json(capsys, ["memory", *TRAIN, "--schedule", str(path), "--json"])
    by_name = _json(capsys, ["memory", *TRAIN, "--schedule", "zb-v", "--json"])
    assert by_file["ranks"] == by_name["ranks"]
