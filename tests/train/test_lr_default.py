"""`--lr` left out: 3e-3 x min(1, 256 / hidden) of the model actually trained (issue 35:
3e-3 diverged at hidden 4096), resolved once with the model (stp.train.run.resolve)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stp.cli.main import main
from stp.train.run.config import ModelShape, TrainJob
from stp.train.run.resolve import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from _hf import build  # noqa: E402


def _lr(**shape: int) -> float:
    job = TrainJob(pp=1, schedule="1f1b", model=ModelShape(**shape))
    return resolve(job).job.lr  # type: ignore[return-value]


def test_default_at_toy_width_keeps_3e_3():
    assert _lr() == 3e-3  # the toy model (hidden 64): existing figures keep their numbers
    assert _lr(hidden=64, heads=4) == 3e-3
    assert _lr(hidden=256, heads=4) == 3e-3


def test_default_falls_as_one_over_hidden_above_256():
    # hand-computed: 3e-3 * 256 / 4096 = 1.875e-4, 3e-3 * 256 / 1024 = 7.5e-4
    assert _lr(hidden=4096, heads=32, layers=1) == pytest.approx(1.875e-4, rel=1e-12)
    assert _lr(hidden=1024, heads=8, layers=1) == pytest.approx(7.5e-4, rel=1e-12)


def test_given_lr_is_kept_at_any_width():
    job = TrainJob(pp=1, schedule="1f1b", lr=0.02, model=ModelShape(hidden=4096, heads=32))
    assert resolve(job).job.lr == 0.02


def test_init_from_checkpoint_uses_its_own_width(tmp_path):
    ckpt = tmp_path / "llama"
    build("llama", ckpt, hidden_size=512, num_attention_heads=4, num_key_value_heads=4,
          num_hidden_layers=1)
    job = TrainJob(pp=1, schedule="1f1b", init_from=str(ckpt))
    assert resolve(job).job.lr == pytest.approx(3e-3 * 256 / 512, rel=1e-12)


def test_help_states_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3e-3 x min(1, 256 / hidden)" in text
