"""The plan -> train hand-off: a plan records its model (format 2), `stp train
--model` builds it, `stp train --plan` trains it or refuses it in one line,
`stp memory --plan` prices it, and `stp plan` shows its progress on a terminal."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from stp.cli import plan as plan_cli
from stp.cli.main import main
from stp.costmodel import MODELS
from stp.costmodel.decoder.spec import num_parameters
from stp.train.run.config import TrainJob
from stp.train.run.resolve import resolve

# stp train's --layers 4 --hidden 32 --heads 4 --kv-heads 2 on bytes, as a config.json:
# intermediate_size is the decoder's default SwiGLU width for hidden 32 (8h/3 -> 128)
CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "max_position_embeddings": 64,
          "tie_word_embeddings": False}
SHAPE = ["--layers", "4", "--hidden", "32", "--heads", "4", "--kv-heads", "2"]
RUN = ["--pp", "1", "--schedule", "1f1b", "-m", "2", "--microbatch-size", "1", "--seq-len",
       "16", "--dtype", "float64", "--steps", "2", "--timeout", "60", "--json"]


def _config(tmp_path: Path, **changes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, **changes}))
    return str(path)


def _losses(capsys, argv) -> list[float]:
    assert main(["train", *argv]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return [r["loss"] for r in rows if "loss" in r]


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_model_config_json_trains_the_model_its_flags_describe(capsys, tmp_path):
    # the same shape named two ways, the same seed: the same model, the same losses
    by_flags = _losses(capsys, [*RUN, *SHAPE, "--out", str(tmp_path / "a")])
    by_model = _losses(capsys, [*RUN, "--model", _config(tmp_path), "--out",
                                str(tmp_path / "b")])
    assert len(by_model) == 2 and by_model == by_flags


def test_model_preset_keeps_its_shape_and_vocabulary():
    run = resolve(TrainJob(model_name="qwen2-12.1b", pp=2))
    spec, c = MODELS["qwen2-12.1b"], run.config
    assert (c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.ffn_hidden, c.vocab_size) \
        == (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab)
    moe = resolve(TrainJob(model_name="mixtral-8x7b", pp=2)).config
    assert (moe.num_experts, moe.top_k) == (8, 2) and run.family.name == "decoder"


def test_model_preset_with_fields_trains_like_the_flags(capsys, tmp_path):
    preset = "qwen2-12.1b,layers=4,hidden=32,heads=4,kv_heads=2,ffn=128,vocab=256,tp=1"
    by_flags = _losses(capsys, [*RUN, *SHAPE, "--out", str(tmp_path / "a")])
    by_model = _losses(capsys, [*RUN, "--model", preset, "--out", str(tmp_path / "b")])
    assert by_model == by_flags


@pytest.mark.parametrize("argv,message", [
    (["--model", "qwen2-12.1b", "--layers", "2"], "--layers 2 contradicts --model qwen2-12.1b"),
    (["--model", "zb-1.5b"], "GPT-style preset"),
    (["--model", "no-such-model"], "unknown model preset 'no-such-model'"),
    (["--model", "missing/config.json"], "no such file"),
])
def test_bad_model_flags_are_one_line(capsys, tmp_path, argv, message):
    err = _one_line_error(capsys, ["train", *argv, "--out", str(tmp_path / "r")])
    assert message in err


def _plan_file(tmp_path: Path, job: dict, fmt: int = 2, model: dict | None = None) -> str:
    doc: dict = {"format": fmt, "plans": [{"job": job, "flags": []}]}
    if model is not None:
        doc["model"] = model
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return str(path)


JOB = {"pp": 1, "tp": 1, "dp": 1, "schedule": "1f1b", "microbatches": 2,
       "microbatch_size": 1, "seq_len": 16, "dtype": "float64"}


def test_a_model_on_the_command_line_must_agree_with_the_plan(capsys, tmp_path):
    plan = _plan_file(tmp_path, {"model_name": "qwen2-12.1b", **JOB},
                      model={"preset": "qwen2-12.1b"})
    err = _one_line_error(capsys, ["train", "--plan", plan, "--model", "qwen2-72b",
                                   "--out", str(tmp_path / "r")])
    assert ("--model qwen2-72b disagrees with --plan" in err and "layers 80 vs 38" in err
            and "hidden 8192 vs 5120" in err)


def test_a_changed_config_json_is_refused(capsys, tmp_path):
    path = _config(tmp_path)
    from stp.train.run.model_source import file_sha256

    plan = _plan_file(tmp_path, {"model_name": path, **JOB},
                      model={"config": path, "sha256": file_sha256(path)})
    _config(tmp_path, num_hidden_layers=2)
    err = _one_line_error(capsys, ["train", "--plan", plan, "--out", str(tmp_path / "r")])
    assert "has changed since" in err and "re-plan" in err


def test_format_1_plans_train_the_flags_model_and_say_so(capfd, tmp_path):
    plan = _plan_file(tmp_path, JOB, fmt=1)
    assert main(["train", *SHAPE, "--steps", "1", "--timeout", "60", "--json", "--plan", plan,
                 "--out", str(tmp_path / "r")]) == 0
    err = capfd.readouterr().err  # said on the process's stderr (stp.cli.train_supervise.say)
    assert "format 1 plan and carries no model" in err


@pytest.mark.parametrize("fmt,job,message", [
    (3, JOB, "plan format 3 is newer than this stp reads"),
    (2, JOB, "names no model"),
    (1, {"model_name": "qwen2-12.1b", **JOB}, "format 1 plan carries no model_name"),
])
def test_plan_formats_are_checked(capsys, tmp_path, fmt, job, message):
    err = _one_line_error(capsys, ["train", "--plan", _plan_file(tmp_path, job, fmt),
                                   "--out", str(tmp_path / "r")])
    assert message in err


def _plan(tmp_path: Path, model: str, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", model, *extra, "--out", str(out), "--json"]) == 0
    return json.loads(out.read_text())


def test_tiny_config_json_plan_trains_two_steps(capfd, tmp_path):
    cfg = _config(tmp_path)
    doc = _plan(tmp_path, cfg, "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
                "--seq-len", "32", "--hardware", "a100-80g", "--top", "2")
    capfd.readouterr()
    assert doc["format"] == 2 and doc["model"]["config"] == str(Path(cfg).resolve())
    row = doc["plans"][0]
    assert row["flags"][:2] == ["--model", str(Path(cfg).resolve())]
    job = row["job"]
    assert job["pp"] * job["tp"] * job["dp"] == 4
    # the workers are processes of their own: their lines are read at the descriptor
    steps = [r for r in (json.loads(x) for x in _train_out(capfd, tmp_path)) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in steps)


def _train_out(capfd, tmp_path: Path) -> list[str]:
    assert main(["train", "--plan", str(tmp_path / "plan.json"), "--steps", "2", "--json",
                 "--timeout", "120", "--out", str(tmp_path / "run")]) == 0
    return [x for x in capfd.readouterr().out.splitlines() if x.startswith("{")]


PRESET_PLAN = ["--gpus", "16", "--global-batch", "16", "--seq-len", "2048", "--hardware",
               "h100-80g", "--schedules", "1f1b", "--partition", "even", "--top", "1"]


def test_a_preset_plan_is_priced_by_memory_and_refused_by_train(capsys, tmp_path,
                                                                monkeypatch):
    doc = _plan(tmp_path, "qwen2-12.1b", *PRESET_PLAN)
    capsys.readouterr()
    job = doc["plans"][0]["job"]
    plan = str(tmp_path / "plan.json")
    assert main(["memory", "--plan", plan, "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    ranks = est["ranks"]
    assert len(ranks) == job["pp"]
    # the preset's parameters, cut tp ways (the vocabulary padded to a multiple of tp)
    held = sum(r["parameters"] for r in ranks) * job["tp"]
    assert held == pytest.approx(num_parameters(MODELS["qwen2-12.1b"]), rel=1e-3)
    # this machine cannot hold a 12B model's ranks: the pre-launch check says so (no
    # --out: a given one is first checked for a checkpoint's free space, which a 12B
    # model's would not have either; the default is made only after the checks)
    monkeypatch.chdir(tmp_path)
    err = _one_line_error(capsys, ["train", "--plan", plan])
    assert "this run needs an estimated" in err and f"{job['pp'] * job['tp'] * job['dp']} " \
        "ranks" in err


def test_memory_plan_with_a_model_is_one_line(capsys, tmp_path):
    plan = _plan_file(tmp_path, {"model_name": "qwen2-12.1b", **JOB},
                      model={"preset": "qwen2-12.1b"})
    err = _one_line_error(capsys, ["memory", "--plan", plan, "--model", "qwen2-72b"])
    assert "carries its model; drop --model" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


SMALL = ["--model", "layers=8,hidden=1024,heads=16,kv_heads=4,ffn=4096,vocab=32000,"
         "sequence=2048", "--gpus", "8", "--gpus-per-node", "4", "--global-batch", "16",
         "--seq-len", "2048", "--hardware", "a100-80g", "--schedules", "1f1b,zb-v",
         "--partition", "even", "--top", "1"]


@pytest.mark.parametrize("as_json,tty", [(False, True), (True, True), (False, False)])
def test_progress_line_only_on_a_terminal_without_json(capsys, monkeypatch, as_json, tty):
    monkeypatch.setattr(plan_cli, "PROGRESS_EVERY_S", 0.0)  # every call: no clock needed
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["plan", *SMALL, *(["--json"] if as_json else [])]) == 0
    text = err.getvalue()
    if tty and not as_json:
        assert "\rplan: " in text and " priced, " in text and "best " in text
        assert text.endswith("\r\x1b[K")  # cleared before the table
    else:
        assert text == ""


def test_top_1_says_how_many_fit(capsys):
    assert main(["plan", *SMALL]) == 0
    why = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("why:"))
    assert "only configuration" not in why and "is the best of" in why


def test_model_with_init_from_takes_the_weights_of_a_checkpoint_of_its_shape(tmp_path):
    import torch

    from stp.models import ModelConfig, build_reference
    from stp.models.hf import save_state

    # a tiny stp model saved as a Hugging Face folder (as tests/models/test_hf_hostile.py)
    config = ModelConfig(vocab_size=40, hidden=16, num_layers=4, num_heads=2, num_kv_heads=2,
                         ffn_hidden=32, max_seq_len=64, seed=1)
    folder = tmp_path / "hf"
    model = build_reference(config, torch.float32)
    save_state(folder, {n: p.detach() for n, p in model.named_parameters()}, config)
    got = resolve(TrainJob(model_name=str(folder / "config.json"), init_from=str(folder),
                           pp=1)).config
    assert got == resolve(TrainJob(init_from=str(folder), pp=1)).config
    with pytest.raises(ValueError, match=r"--model qwen2-12.1b is not the --init-from .* "
                       r"checkpoint's shape \(layers 38 vs 4, hidden 5120 vs 16"):
        resolve(TrainJob(model_name="qwen2-12.1b", init_from=str(folder), pp=1))
