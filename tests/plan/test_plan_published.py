"""The planner's prices order published configurations as their papers measured them.

Only orderings that are stable under the cost model's assumptions are
asserted (benchmarks/bench_plan.py prints the figures and
benchmarks/results/plan.md discusses them).
"""

from stp.costmodel import HARDWARE, MODELS
from stp.plan import PlanRequest
from stp.plan.planner import priced_at
from stp.plan.space import Mesh, chunk_options


def test_torchtitan_405b_interleaved_beats_1f1b_at_dp8_tp8_pp8():
    # "TorchTitan" (arXiv 2410.06511), Table 5: interleaved 1F1B 28% faster than
    # 1F1B on 512 H100s; stp shards the optimizer (not the parameters) over dp8.
    req = PlanRequest(model=MODELS["llama3-405b"], hardware=HARDWARE["h100-80g"], gpus=512,
                      global_batch=128, seq_len=8192)
    # At every v the planner tries (two and more chunks per rank) interleaving wins.
    plain = priced_at(req, Mesh(8, 8, 8), 1, "1f1b")
    assert plain is not None and plain.config.features.shard_optimizer
    for v in (None, 4, 8):
        inter = priced_at(req, Mesh(8, 8, 8), 1, "1f1b-interleaved", v)
        assert inter is not None and inter.step_s < plain.step_s, v
        assert inter.config.features.shard_optimizer
        assert max(plain.peak_bytes, inter.peak_bytes) <= req.budget


def test_stp_paper_12b_stp_ahead_of_1f1b_i_and_zb_v():
    # STP (arXiv 2510.27257): qwen2-12.1b at TP8 PP2, sequence 6144.
    req = PlanRequest(model=MODELS["qwen2-12.1b"], hardware=HARDWARE["a800-80g"], gpus=16,
                      global_batch=32, seq_len=6144)
    got = {n: priced_at(req, Mesh(2, 8, 1), 1, n) for n in ("stp", "zb-v")}
    got.update({f"1f1b-interleaved v{v}": priced_at(req, Mesh(2, 8, 1), 1, "1f1b-interleaved", v)
                for v in chunk_options("1f1b-interleaved", 2, req.model.layers)})
    assert all(p is not None for p in got.values()) and len(got) > 3
    stp = got.pop("stp").step_s
    assert all(stp < p.step_s for p in got.values())  # 1F1B-I at its best v too
