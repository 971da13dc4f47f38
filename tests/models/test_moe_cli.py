"""`stp train` with the MoE family: a Mixtral checkpoint through --init-from (the
family read from config.json, no --arch), its first loss equal to
transformers', `aux_loss` and `expert_load` beside `loss` in --json, --save-hf
loaded back by transformers with no missing or unexpected keys; bad MoE
settings refused in one line, exit 2, before any worker starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _hf
import _hf_moe
import pytest
import torch

from stp.cli.main import main
from stp.train.data.tokens import TokenBatches, TokenStream, eos_id, tokenize

SEQ, GLOBAL_BATCH = 16, 8


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixtral")
    _hf_moe.build_moe("mixtral", path, seed=4, num_hidden_layers=4)
    _hf.save_tokenizer(path, _hf.corpus_text())
    return path


def test_init_from_a_mixtral_trains_from_transformers_loss_and_saves_back(
    mixtral: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    data, saved = tmp_path / "data.txt", tmp_path / "saved"
    data.write_text(_hf.corpus_text(2000, seed=1))
    cmd = [sys.executable, "-m", "stp.cli.main", "train", "--init-from", str(mixtral),
           "--data", str(data), "--steps", "1", "--dtype", "float64", "--seq-len", str(SEQ),
           "--pp", "2", "--schedule", "stp", "-m", "4", "--microbatch-size", "2", "--json",
           "--timeout", "60", "--out", str(tmp_path / "run"), "--save-hf", str(saved)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.splitlines()[0])
    assert row["aux_loss"] > 0 and row["expert_load"] >= 1.0
    theirs = _hf_moe.load_moe(mixtral)
    tok = mixtral / "tokenizer.json"
    eos = eos_id(tok, json.loads((mixtral / "config.json").read_text()))
    batches = TokenBatches(TokenStream(tokenize(str(data), tok, eos)), SEQ, GLOBAL_BATCH, 0)
    with torch.no_grad():
        want = _hf.hf_loss(theirs, *batches.batch(0)).item()
    assert abs(row["loss"] - want) < 1e-6 * want  # router softmax: float32 in transformers
    model, info = AutoModelForCausalLM.from_pretrained(
        saved, dtype=torch.float64, experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert json.loads((saved / "config.json").read_text())["model_type"] == "mixtral"


@pytest.mark.parametrize("flags, says", [
    (["--experts", "4", "--top-k", "5"], "--top-k 5 must be <= --experts 4"),
    (["--moe-every", "9"], "--moe-every 9 must be <= --layers 4"),
    (["--expert-ffn", "30", "--tp", "4"], "--expert-ffn 30 must be divisible by --tp 4"),
    (["--sequence-parallel", "--tp", "2"], "no sequence parallelism"),
    (["--dp", "4", "--ep", "3"], "--ep 3 must divide --dp 4"),
    (["--experts", "6", "--top-k", "1", "--dp", "4", "--ep", "4"],
     "--experts 6 must be divisible by --ep 4"),
])
def test_bad_moe_settings_are_refused_in_one_line(flags: list[str], says: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.txt"
    data.write_text("some text " * 200)
    code = main(["train", "--arch", "moe", *flags, "--steps", "1", "--data", str(data),
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and says in err, err


@pytest.mark.parametrize("flags", [[], ["--arch", "mllm"]], ids=["decoder", "mllm"])
def test_expert_parallelism_without_experts_is_refused_in_one_line(
        flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", *flags, "--dp", "2", "--ep", "2", "--steps", "1",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--ep 2: expert parallelism needs a " \
        "mixture-of-experts model" in err, err


def test_arch_moe_refuses_a_dense_checkpoint(checkpoints: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--arch", "moe", "--init-from", str(checkpoints["llama"]), "--steps",
                 "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is not a mixture of experts" in err and len(err.splitlines()) == 1


@pytest.mark.slow  # three runs of stp train (about a minute on a loaded 2-core machine)
def test_resume_is_exact_and_restores_the_experts(tmp_path: Path) -> None:
    """Two steps then one resumed (the MoE flags restored from run.json, on another
    mesh and schedule) give the third step of an uninterrupted run, float64."""
    data = tmp_path / "data.txt"
    data.write_text(_hf.corpus_text(2000, seed=2))
    run = ["--dtype", "float64", "--json", "--data", str(data), "--seq-len", "8", "-m", "2",
           "--microbatch-size", "2", "--timeout", "60"]
    moe = ["--arch", "moe", "--experts", "3", "--top-k", "2", "--shared-expert-ffn", "8",
           "--moe-every", "2", "--layers", "4", "--hidden", "16", "--heads", "2"]

    def train(*args: str) -> list[dict]:
        cmd = [sys.executable, "-m", "stp.cli.main", "train", *run, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return [json.loads(line) for line in done.stdout.splitlines() if '"step"' in line]

    whole = train(*moe, "--pp", "1", "--schedule", "1f1b", "--steps", "3", "--out",
                  str(tmp_path / "whole"))
    train(*moe, "--pp", "1", "--schedule", "1f1b", "--steps", "2", "--out",
          str(tmp_path / "cut"))
    resumed = train("--resume", str(tmp_path / "cut"), "--pp", "2", "--schedule", "stp",
                    "--steps", "3")
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "aux_loss", "expert_load"):
        assert abs(resumed[0][key] - whole[2][key]) <= 1e-9 * abs(whole[2][key]), key


def test_stp_memory_prices_an_moe_config_with_every_expert(
    mixtral: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Mixtral config.json is priced as a mixture of experts (stp.costmodel.moe):
    at pp 1 the weights counted are every weight transformers builds, each expert's."""
    code = main(["memory", "--model", str(mixtral / "config.json"), "--pp", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    counted = json.loads(out)["ranks"][0]["parameters"]
    theirs = _hf_moe.load_moe(mixtral)
    assert counted == sum(p.numel() for p in theirs.parameters())
