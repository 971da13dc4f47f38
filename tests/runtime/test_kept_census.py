"""The bytes `stp.costmodel.decoder.kept` says stp's decoder units keep are the bytes they
keep: `stp.runtime.offload`'s census of one forward (every storage it keeps, once),
on one rank, for one and two layers, float32 and bfloat16; and a TP shard made by
random initialisation holds only its own bytes."""

import dataclasses

import pytest
import torch

from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.kept import stp_kept
from stp.models import ModelConfig, StagePlacement, build_stage
from stp.runtime.executor import Executor
from stp.runtime.offload import ActivationOffloader, runtime_plan
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule

SEQ, MBS, HIDDEN = 16, 2, 64
SCHEDULE = "zb-v"


def _config(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=80, hidden=HIDDEN, num_layers=layers, num_heads=4,
                       num_kv_heads=2, ffn_hidden=176, max_seq_len=SEQ, seed=1)


def _census(layers: int, dtype: torch.dtype, recompute: str = "none"):
    """The offloader's census of one microbatch through zb-v's two stages on one rank:
    what F keeps until B, and B until W, per (stage, microbatch)."""
    sch = make_schedule(SCHEDULE, 1, 1)
    cfg = _config(layers)
    stages = {s: build_stage(cfg, StagePlacement(s, 2, dtype=dtype, recompute=recompute))
              for s in (0, 1)}
    off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, "none"))
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, HIDDEN), dtype=dtype,
                  offload=off)
    tok = torch.randint(0, cfg.vocab_size, (MBS, SEQ + 1),
                        generator=torch.Generator().manual_seed(0))
    ex.run([tok[:, :-1]], [tok[:, 1:]])
    return off.memory


def _kept_by_one_forward(layers: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes microbatch 0 keeps on stage 0 (embedding + half the layers) and stage 1
    (the other half + the loss head) of zb-v on one rank."""
    kept = _census(layers, dtype).forward_bytes
    return kept[(0, 0)], kept[(1, 0)]


@pytest.mark.parametrize("schedule", ["zb-v", "1f1b-interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_census_formulas_match_what_a_forward_keeps(dtype, schedule, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "SCHEDULE", schedule)
    width = torch.finfo(dtype).bits // 8
    spec = spec_from_config(_config(2), seq_len=SEQ, microbatch_size=MBS)
    kept = stp_kept(spec, width, native_weights=schedule == "1f1b-interleaved")
    two, four = _kept_by_one_forward(2, dtype), _kept_by_one_forward(4, dtype)
    assert four[0] - two[0] == four[1] - two[1] == kept.layer_b  # one more layer per stage
    assert two[1] == kept.layer_b + kept.last_b
    assert two[0] == kept.layer_b + kept.first_b


def test_a_random_init_tp_shard_holds_only_its_own_bytes():
    from stp.models.decoder.init import init_shard, parameter_specs

    cfg = _config(1)
    for spec in parameter_specs(cfg):
        t = init_shard(cfg, spec, 2, 1)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), spec.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_recomputation_census(dtype):
    """Full recomputation at t = 1: a stage of one layer keeps what the formulas say
    (the fused chunk's input, and the ends'), more layers add nothing (one chunk
    input per stage: the formula's w h per layer bounds it), and a deferred W gets
    exactly the bytes it gets without recomputation (the formulas' B-to-W)."""
    width = torch.finfo(dtype).bits // 8
    spec = spec_from_config(_config(2), seq_len=SEQ, microbatch_size=MBS)
    kept = stp_kept(dataclasses.replace(spec, recompute="full"), width)
    two, four = _census(2, dtype, "full"), _census(4, dtype, "full")
    added = four.forward_bytes[(0, 0)] - two.forward_bytes[(0, 0)]
    assert 0 <= added <= kept.layer_b
    assert two.forward_bytes[(0, 0)] == kept.layer_b + kept.first_b
    assert two.forward_bytes[(1, 0)] == kept.layer_b + kept.last_b
    for stage, end in ((0, kept.first_w), (1, kept.last_w)):
        assert two.weight_bytes[(stage, 0)] == kept.layer_w + end
        assert four.weight_bytes[(stage, 0)] == 2 * kept.layer_w + end
    assert two.weight_bytes == _census(2, dtype).weight_bytes
