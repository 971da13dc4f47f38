"""`stp train` resumes and writes as torchtitan and Hugging Face Trainer users expect:
`--resume DIR` goes on writing into DIR and restores the model settings, a flag that
contradicts them is refused by its own name, a finished run has nothing to do, an
`--out` holding another run is refused, `--json` counts steps from 1, a Hugging Face
directory needs a tokenizer, `--data DIR` reads only text files, and the progress
line clears what it overwrites."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from stp.cli.main import main
from stp.cli.train_output import Progress as _Progress
from stp.train.checkpoint import sharded as checkpoint
from stp.train.data.corpus import open_corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from _hf import build  # noqa: E402

# a model that is not the default shape: --resume alone must bring it back
SHAPE = ["--pp", "1", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--microbatch-size", "1", "-m", "2", "--timeout", "60"]


def _train(capfd, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    got = capfd.readouterr()
    return code, got.out, got.err


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *SHAPE, "--steps", "2", "--out", str(out), "--json"]) == 0
    return out


def test_resume_alone_restores_the_model_and_writes_into_the_run(first_run, capfd):
    code, out, err = _train(capfd, "--resume", str(first_run), "--steps", "3", "--json",
                            "--pp", "1", "--microbatch-size", "1", "-m", "2")
    assert code == 0, err
    assert f"resuming from step 2 ({first_run / 'step-00000002'})" in err
    assert [r["step"] for r in map(json.loads, out.splitlines()) if "loss" in r] == [3]
    assert checkpoint.latest(first_run).name == "step-00000003"  # written into the run
    assert "steps 3..3, resumed after step 2" in err


def test_a_flag_contradicting_the_resumed_model_is_refused_by_its_name(first_run, capfd):
    code, _, err = _train(capfd, "--resume", str(first_run), "--steps", "9", "--hidden", "64",
                          "--pp", "1")
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "--hidden 64 contradicts the run being resumed" in err and "--hidden 32" in err
    assert "ffn_hidden" not in err


def test_a_finished_run_has_nothing_to_do(first_run, capfd):
    done = checkpoint.latest(first_run)
    code, out, err = _train(capfd, "--resume", str(first_run), "--steps", "1", "--pp", "1")
    assert code == 0 and out == ""
    assert err.strip() == (f"stp: nothing to do: {done} has trained "
                           f"{int(done.name.split('-')[1])} steps and --steps is 1; give "
                           f"--steps above {int(done.name.split('-')[1])} to train on")


def test_an_out_holding_another_run_is_refused_without_resume(first_run, capfd):
    code, _, err = _train(capfd, *SHAPE, "--steps", "1", "--out", str(first_run))
    assert code == 2
    assert "holds another run's checkpoints" in err and f"--resume {first_run}" in err


def test_a_hugging_face_directory_without_a_tokenizer_is_refused(tmp_path, capfd):
    build("llama", tmp_path / "llama")
    out = tmp_path / "out"
    code, _, err = _train(capfd, "--init-from", str(tmp_path / "llama"), "--pp", "1",
                          "--steps", "1", "--out", str(out))
    assert code == 2
    assert "has no tokenizer.json" in err and "--tokenizer PATH" in err
    assert not out.exists()


def test_data_directories_skip_hidden_cache_and_binary_files(tmp_path, capfd):
    data = tmp_path / "data"
    (data / ".git").mkdir(parents=True)
    (data / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 100)
    (data / "__pycache__").mkdir()
    (data / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0\1\2" * 400)
    (data / ".hidden.txt").write_text("secret " * 300)
    (data / "blob.bin").write_bytes(b"text then a NUL\0" * 100)
    (data / "a.txt").write_text("the quick brown fox " * 100)
    (data / "b.txt").write_text("jumps over the lazy dog " * 100)
    corpus = open_corpus(data)
    assert [f.name for f in corpus.files] == ["a.txt", "b.txt"]
    assert corpus.skipped == 4
    code, _, err = _train(capfd, *SHAPE, "--steps", "1", "--data", str(data),
                          "--out", str(tmp_path / "out"))
    assert code == 0, err
    assert (f"data: bytes {data}: 2 documents, {corpus.size:,} tokens, 4 skipped") in err


def test_the_progress_line_clears_what_it_overwrites(capfd):
    bar = _Progress(total=2, as_json=False)
    bar.tty = True
    report = SimpleNamespace(step=0, loss=1.0, tokens_per_s=1000.0, step_time_s=0.1,
                             grad_norm=None, lr=None, eval_loss=2.5, skipped=False)
    bar(report)
    bar(SimpleNamespace(**{**vars(report), "step": 1, "eval_loss": None}))
    err = capfd.readouterr().err
    second = err.split("\r")[-1]
    assert second.startswith("step 2/2") and "eval" not in second
    assert second.rstrip("\n").endswith("\x1b[K")  # the old eval loss is erased


@pytest.mark.parametrize("argv, line", [
    (["--hidden", "30", "--heads", "4"], "--hidden 30 must be divisible by --heads 4"),
    (["--heads", "4", "--kv-heads", "3"],
     "--heads 4 must be divisible by --kv-heads 3 (grouped-query attention)"),
    (["--tp", "3", "--pp", "1"], "--heads 4 must be divisible by --tp 3"),
])
def test_shape_errors_name_the_flags_not_the_fields(argv, line, capfd):
    code, _, err = _train(capfd, *argv, "--steps", "1")
    assert code == 2
    assert err.strip() == f"stp: error: {line}"


@pytest.mark.parametrize("argv, needle", [
    (["--seq-len", "1048576"], "is available; give a shorter --seq-len"),
    (["--memory-budget", "1MB"], "--memory-budget 1MB: pipeline rank 0 needs an estimated"),
    (["--memory-budget", "80XB"], "--memory-budget '80XB' is not a size"),
])
def test_a_run_that_cannot_fit_is_refused_before_any_worker(argv, needle, capfd, tmp_path):
    out = tmp_path / "out"
    code, _, err = _train(capfd, *argv, "--steps", "1", "--out", str(out))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert not any(out.glob("step-*"))  # nothing trained


def test_the_estimate_is_close_to_what_the_default_run_holds(capfd, tmp_path):
    """The pre-launch estimate of the README's run (the defaults) against the resident
    activations the run measures per rank."""
    from stp.train.run.config import TrainJob
    from stp.train.run.memory_check import run_estimate
    from stp.train.run.resolve import resolve

    code, out, err = _train(capfd, "--steps", "1", "--json", "--out", str(tmp_path / "out"))
    assert code == 0, err
    measured = json.loads(out.splitlines()[0])["resident_activation_bytes"]
    est = run_estimate(resolve(TrainJob()))
    assert len(est.ranks) == len(measured) == 2
    for rank, got in zip(est.ranks, measured, strict=True):
        assert 0.9 * got <= rank.activations_peak <= 1.5 * got, (rank, got)


def test_a_full_disk_while_writing_the_hugging_face_copy_is_one_line(tmp_path, capfd,
                                                                    monkeypatch):
    import errno

    from stp.train.step import trainer as trainer_mod

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer_mod.Trainer, "save_hf", full)
    hf = tmp_path / "hf"
    code, _, err = _train(capfd, *SHAPE, "--steps", "1", "--out", str(tmp_path / "out"),
                          "--save-hf", str(hf))
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if "save-hf" in ln]
    assert len(lines) == 1 and "no space left on device" in lines[0].lower(), err
    assert "Traceback" not in err


def test_a_damaged_run_settings_file_is_refused_in_one_line(first_run, tmp_path, capfd):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(first_run, copy)
    (copy / ".stp-lock").unlink(missing_ok=True)
    doc = json.loads((copy / "run.json").read_text())
    doc["settings"]["model"]["seq_len"] = "long"
    (copy / "run.json").write_text(json.dumps(doc))
    code, _, err = _train(capfd, "--resume", str(copy), "--steps", "9", "--pp", "1")
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "--seq-len is 'long', not a int" in err and "run.json" in err
