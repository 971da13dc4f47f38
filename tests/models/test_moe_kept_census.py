"""The bytes `stp.costmodel.decoder.kept` says an MoE layer keeps from F to B are what stp's
MoE units keep: `stp.runtime.offload`'s census of one forward (every storage kept,
once), one more layer per stage, with and without a shared expert, k 1 and 2."""

import pytest
import torch

from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.kept import stp_kept
from stp.models import StagePlacement
from stp.models.moe.stage import build_moe_stage
from stp.runtime.executor import Executor
from stp.runtime.offload import ActivationOffloader, runtime_plan
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule
from stp.shapes import MoEConfig

SEQ, MBS, HIDDEN = 16, 2, 64


def _config(layers: int, top_k: int, shared: int) -> MoEConfig:
    return MoEConfig(vocab_size=80, hidden=HIDDEN, num_layers=layers, num_heads=4,
                     num_kv_heads=2, ffn_hidden=176, max_seq_len=SEQ, seed=1, num_experts=4,
                     top_k=top_k, expert_ffn=48, shared_expert_ffn=shared)


def _kept_on_stage_0(cfg: MoEConfig, schedule: str, dtype: torch.dtype) -> int:
    sch = make_schedule(schedule, 1, 1)
    stages = {s: build_moe_stage(cfg, StagePlacement(s, 2, dtype=dtype)) for s in (0, 1)}
    off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, "none"))
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, HIDDEN), dtype=dtype,
                  offload=off)
    tok = torch.randint(0, cfg.vocab_size, (MBS, SEQ + 1),
                        generator=torch.Generator().manual_seed(0))
    ex.run([tok[:, :-1]], [tok[:, 1:]])
    return off.memory.forward_bytes[(0, 0)]


@pytest.mark.parametrize("schedule,dtype,top_k,shared", [
    ("zb-v", torch.float32, 2, 32), ("1f1b-interleaved", torch.bfloat16, 1, 0)])
def test_moe_layer_bytes_match_what_a_forward_keeps(schedule, dtype, top_k, shared):
    width = torch.finfo(dtype).bits // 8
    two, four = (_kept_on_stage_0(_config(n, top_k, shared), schedule, dtype) for n in (2, 4))
    spec = spec_from_config(_config(2, top_k, shared), seq_len=SEQ, microbatch_size=MBS)
    kept = stp_kept(spec, width, native_weights=schedule == "1f1b-interleaved")
    tokens = SEQ * MBS
    # the per-layer constant is fitted to this census (stp.costmodel.decoder.kept): within 16
    # bytes a token, against the 2.9-6.8 KB a token the layer keeps
    assert abs((four - two) - kept.layer_b) <= 16 * tokens
