"""The planner's prices order published configurations as their papers measured them.

Only orderings that are stable under the cost model's assumptions are
asserted (benchmarks/bench_plan.py prints the figures and
benchmarks/results/plan.md discusses them).
"""

from stp.costmodel import HARDWARE, MODELS
from stp.plan import PlanRequest
from stp.plan.planner import priced_at
from stp.plan.space import Mesh


def test_torchtitan_405b_interleaved_beats_1f1b_at_dp8_tp8_pp8():
    # "TorchTitan" (arXiv 2410.06511), Table 5: interleaved 1F1B 28% faster than
    # 1F1B on 512 H100s; stp shards the optimizer (not the parameters) over dp8.
    req = PlanRequest(model=MODELS["llama3-405b"], hardware=HARDWARE["h100-80g"], gpus=512,
                      global_batch=128, seq_len=8192)
    plain = priced_at(req, Mesh(8, 8, 8), 1, "1f1b")
    inter = priced_at(req, Mesh(8, 8, 8), 1, "1f1b-interleaved")
    assert plain is not None and inter is not None
    assert inter.step_s < plain.step_s
    assert plain.config.features.shard_optimizer and inter.config.features.shard_optimizer
    assert max(plain.peak_bytes, inter.peak_bytes) <= req.budget


def test_stp_paper_12b_stp_ahead_of_1f1b_i_and_zb_v():
    # STP (arXiv 2510.27257): qwen2-12.1b at TP8 PP2, sequence 6144.
    req = PlanRequest(model=MODELS["qwen2-12.1b"], hardware=HARDWARE["a800-80g"], gpus=16,
                      global_batch=32, seq_len=6144)
    got = {n: priced_at(req, Mesh(2, 8, 1), 1, n) for n in ("stp", "1f1b-interleaved", "zb-v")}
    assert all(p is not None for p in got.values())
    assert got["stp"].step_s < min(got["1f1b-interleaved"].step_s, got["zb-v"].step_s)
