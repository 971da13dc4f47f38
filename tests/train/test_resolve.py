"""A `stp train` job is resolved once (stp.train.run.resolve): the flags become a frozen
Run that the loop and the Trainer read, the checkpoint's config.json is read once,
and `--partition auto` is decided in one place, pricing the run's own tp."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import stp.train.families.decoder as decoder_job
import stp.train.run.resolve as resolve_mod
from stp.cli.main import main
from stp.shapes import MLLMConfig, ModelConfig
from stp.train.families import family_named, family_of
from stp.train.run.config import ModelShape, TrainJob
from stp.train.run.resolve import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from _hf import build, corpus_text, save_tokenizer  # noqa: E402


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_one_run_resolves_its_job_and_reads_config_json_once(tmp_path, monkeypatch):
    ckpt = tmp_path / "llama"
    build("llama", ckpt)
    save_tokenizer(ckpt, corpus_text())
    resolves = _counting(monkeypatch, resolve_mod, "resolve")
    import stp.train.run.job as job_mod

    monkeypatch.setattr(job_mod, "resolve", resolve_mod.resolve)
    reads = _counting(monkeypatch, decoder_job, "checkpoint_config")
    code = main(["train", "--pp", "1", "--steps", "1", "--init-from", str(ckpt), "-m", "2",
                 "--microbatch-size", "1", "--seq-len", "8", "--out", str(tmp_path / "run")])
    assert code == 0
    assert len(resolves) == 1
    assert len(reads) == 1


def test_the_run_carries_the_partition_it_chose():
    job = TrainJob(pp=2, schedule="1f1b", partition="auto",
                   model=ModelShape(layers=6, hidden=32, heads=4, seq_len=16))
    run = resolve(job)
    assert run.partition is not None and sum(run.partition) == 6
    assert run.job.partition == ",".join(map(str, run.partition))
    assert run.layer_counts() == list(run.partition)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.partition = None  # type: ignore[misc]


def test_auto_partition_prices_the_runs_own_tp(monkeypatch):
    seen = []
    real = decoder_job.DECODER.cost_spec

    def spy(config, **kw):
        seen.append(kw["tp"])
        return real(config, **kw)

    monkeypatch.setattr(decoder_job.DECODER, "cost_spec", spy)
    resolve(TrainJob(pp=2, tp=2, schedule="1f1b", partition="auto",
                     model=ModelShape(layers=6, hidden=32, heads=4, seq_len=16)))
    assert seen == [2]


def test_families_are_found_by_name_and_by_config():
    from stp.shapes.moe import MoEConfig

    assert family_named("decoder").model.config_type is ModelConfig
    assert family_named("mllm").model.config_type is MLLMConfig
    assert family_of(ModelConfig()) is family_named("decoder")
    assert family_of(lambda *a, **k: None) is None
    assert family_of(MoEConfig()) is family_named("moe")
    with pytest.raises(ValueError, match="--arch 'llava': choose one of decoder, mllm, moe"):
        family_named("llava")
