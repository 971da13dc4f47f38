"""Errors for people: a bad ModelConfig or build_stage argument is refused with a
ValueError naming the value (the stage's runtime behaviour: test_model_stage.py)."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from stp.models import ModelConfig, StagePlacement, build_stage

CFG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=7,
)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"vocab_size": 0}, "vocab_size must be >= 1, got 0"),
        ({"hidden": 12.5}, "12.5"),
        ({"num_layers": True}, "True"),
        ({"num_heads": 3}, "num_heads=3"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads=3"),
        ({"hidden": 12, "num_heads": 4, "num_kv_heads": 1}, "head_dim = hidden / num_heads = 3"),
        ({"ffn_hidden": 0}, "ffn_hidden must be >= 1, got 0"),
        ({"max_seq_len": -2}, "-2"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"norm_eps": -1e-6}, "-1e-06"),
        ({"init_std": float("nan")}, "nan"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
    ],
)
def test_bad_config_raises_naming_the_value(kwargs: dict, needle: str):
    with pytest.raises(ValueError, match=re.escape(needle)):
        ModelConfig(**kwargs)


def test_config_defaults_resolve_ffn_hidden():
    assert ModelConfig().ffn_hidden == 384  # 8 * 128 / 3 = 341.3, up to a multiple of 64
    assert ModelConfig(ffn_hidden=100).ffn == 100


@pytest.mark.parametrize(
    "cfg,args,needle",
    [
        (CFG, dict(stage=0, num_stages=5), "num_layers=4 must be >= num_stages=5"),
        (CFG, dict(stage=2, num_stages=2), "got 2"),
        (ModelConfig(hidden=48, num_heads=6, num_kv_heads=3), dict(stage=0, num_stages=1,
         tp_size=2), "num_kv_heads=3 must be divisible by tp_size=2"),
        (CFG, dict(stage=0, num_stages=1, tp_size=3), "num_heads=4 must be divisible by tp_size=3"),
        (ModelConfig(ffn_hidden=66, num_kv_heads=4), dict(stage=0, num_stages=1, tp_size=4),
         "ffn_hidden=66"),
        (CFG, dict(stage=0, num_stages=1, tp_size=2, tp_rank=2), "got 2"),
    ],
)
def test_bad_build_stage_arguments_raise(cfg: ModelConfig, args: dict, needle: str):
    args = dict(args)
    stage, num_stages = args.pop("stage"), args.pop("num_stages")
    with pytest.raises(ValueError, match=re.escape(needle)):
        build_stage(cfg, StagePlacement(stage, num_stages, **args), allreduce=lambda a: a)


def test_tp_without_a_process_group_is_refused(monkeypatch):
    # An in-process trainer earlier in the session leaves its world-1 group up (torn
    # down at exit), so stand in for a process that never initialised one.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="tp_size=2 needs torch.distributed"):
        build_stage(CFG, StagePlacement(0, 1, tp_size=2))
