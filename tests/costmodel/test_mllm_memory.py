"""The multimodal model's byte estimate (stp.costmodel.mllm.memory): its model states
are the parameters the runtime builds, stage by stage and TP shard by TP shard, and
the bytes its units keep are those `stp.runtime.offload`'s census counts."""

import pytest
import torch

from stp.costmodel import HARDWARE
from stp.costmodel.memory import Features, Layout, estimate
from stp.costmodel.mllm.memory import mllm_kept, mllm_stage_parameters
from stp.models import StagePlacement
from stp.models.mllm.family import MLLM
from stp.models.mllm.stage import build_mllm_stage
from stp.runtime.executor import Executor
from stp.runtime.offload import ActivationOffloader, runtime_plan
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule
from stp.shapes import MLLMConfig, ModelConfig, VisionConfig

TEXT, MBS = 16, 2


def _config(hidden=64, vision_layers=2, layers=4, kv_heads=2, vocab=81):
    vision = VisionConfig(image_size=16, patch_size=4, hidden=16, num_layers=vision_layers,
                          num_heads=4)
    decoder = ModelConfig(vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=4,
                          num_kv_heads=kv_heads, ffn_hidden=176,
                          max_seq_len=vision.image_tokens + TEXT, seed=1)
    return MLLMConfig(vision, decoder)


def _spec(cfg, tp=1):
    return MLLM.cost_spec(cfg, sequence=TEXT, micro_batch=MBS, tp=tp)


@pytest.mark.parametrize("tp,kv_heads,partition", [
    (1, 2, (2, 4)), (2, 2, (1, 3, 2)), (2, 1, (3, 3)), (4, 2, (2, 2, 1, 1))])
def test_model_states_are_the_parameters_the_runtime_builds(tp, kv_heads, partition):
    cfg = _config(kv_heads=kv_heads)
    want = mllm_stage_parameters(_spec(cfg, tp), partition)
    for stage in range(len(partition)):
        for rank in range(tp):
            built = build_mllm_stage(cfg, StagePlacement(stage, len(partition), tp_size=tp,
                                                         tp_rank=rank, partition=partition))
            params = list(built.parameters())
            assert sum(p.numel() for p in params) == want[stage], (stage, rank)
            # a shard holds its own bytes only (no view of the unsharded matrix)
            assert sum(p.untyped_storage().nbytes() for p in params) == 4 * want[stage]
    est = estimate(_spec(cfg, tp), HARDWARE["a100-80g"],
                   Layout(pp=len(partition), tp=tp, microbatches=4, microbatch_size=MBS,
                          seq_len=TEXT, schedule="1f1b", partition=partition),
                   Features(dtype="float32", runtime="stp"))
    assert [r.parameters for r in est.ranks] == want
    assert [r.weights for r in est.ranks] == [4 * n for n in want]


def _census(cfg, dtype, recompute="none"):
    """What one microbatch keeps on zb-v's two stages of one rank: F to B and B to W,
    per stage."""
    sch = make_schedule("zb-v", 1, 1)
    part = (cfg.vision.num_layers, cfg.decoder.num_layers)
    stages = {s: build_mllm_stage(cfg, StagePlacement(s, 2, dtype=dtype, partition=part,
                                                      recompute=recompute))
              for s in (0, 1)}
    off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, "none"))
    seq = cfg.seq_len(TEXT)
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, seq, cfg.hidden),
                  dtype=dtype, offload=off)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (MBS, cfg.vision.pixels), generator=g)
    tokens = torch.randint(0, cfg.decoder.vocab_size, (MBS, TEXT), generator=g)
    targets = torch.cat([torch.full((MBS, cfg.vision.image_tokens), -100), tokens], 1)
    ex.run([torch.cat([pixels, tokens], 1)], [targets])
    m = off.memory
    return [(m.forward_bytes[s, 0], m.weight_bytes[s, 0]) for s in (0, 1)]


@pytest.mark.parametrize("hidden,dtype,recompute", [
    (64, torch.float32, "none"),  # merge**2 x 16 = 64: the image rows are views
    (64, torch.bfloat16, "none"),
    (128, torch.float32, "none"),  # narrower: the image rows are copies
    (128, torch.float32, "full"),
])
def test_kept_bytes_are_the_census(hidden, dtype, recompute):
    width = torch.finfo(dtype).bits // 8
    one = _census(_config(hidden, 1, 1), dtype, recompute)
    two = _census(_config(hidden, 2, 1), dtype, recompute)
    k = mllm_kept(_spec(_config(hidden, 1, 1)), width, recompute=recompute)
    assert two[0][0] - one[0][0] == k.block_b
    assert two[0][1] - one[0][1] == k.block_w
    assert one[0] == (k.block_b + k.merger_b + k.input_b, k.block_w + k.merger_w + k.input_w)
    assert one[1] == (k.layer_b + k.last_b, k.layer_w + k.last_w)
