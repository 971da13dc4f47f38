"""The planner's cheap ways to stay fast: a memory bound found without simulating
(it must never exceed the simulated estimate, and is nearly it), and one
simulation shared by lever rungs that change model states only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stp.costmodel import HARDWARE
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.memory import Features, Layout, estimate_run
from stp.costmodel.moe.spec import MoESpec
from stp.plan import PlanRequest
from stp.plan.experts import bound_exact, priced
from stp.plan.price import price
from stp.plan.space import every_config

SMALL = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
                  sequence=2048, gated_mlp=True, flash_attention=True, name="small")
MOE = MoESpec(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
              sequence=2048, gated_mlp=True, flash_attention=True, name="moe-small",
              experts=8, top_k=2, expert_ffn=2048)
HW = HARDWARE["a100-80g"]


def _request(model, **kw):
    base = dict(model=model, hardware=HW, gpus=8, global_batch=16, seq_len=2048,
                gpus_per_node=4, schedules=("1f1b", "zb-v", "stp", "1f1b-interleaved"),
                partition="even", top=3)
    base.update(kw)
    return PlanRequest(**base)


@pytest.mark.parametrize("model", [SMALL, MOE])
def test_exact_memory_bound_never_exceeds_the_simulated_peak(model):
    request = _request(model)
    checked = tight = 0
    for cfg in list(every_config(request))[::5]:
        bound = bound_exact(request, cfg)
        if bound is None:  # offload moves activations in time: no such bound
            assert cfg.features.offload != "none"
            continue
        peak = priced(request, cfg).peak_bytes
        assert bound <= peak * (1 + 1e-12), cfg
        checked += 1
        tight += bound >= 0.99 * peak
    # it is the estimate less the gradient copies: within 1% for most configurations
    assert checked > 20 and tight >= 0.8 * checked


@pytest.mark.parametrize("model", [SMALL, MOE])
def test_a_shared_simulation_prices_as_a_fresh_one(model):
    # the sharded optimizer reuses the simulation of the rung before: the price
    # must be the one estimate_run computes from scratch
    request = _request(model)
    for cfg in list(every_config(request))[::11]:
        for shard in (False, True):
            feats = replace(cfg.features, shard_optimizer=shard and cfg.mesh.dp > 1)
            spec = replace(model, ep=cfg.mesh.ep) if model is MOE else model
            got = price(spec, HW, replace(cfg, features=feats), 2048)
            layout = Layout(pp=cfg.mesh.pp, tp=cfg.mesh.tp, dp=cfg.mesh.dp,
                            microbatches=cfg.microbatches,
                            microbatch_size=cfg.microbatch_size, seq_len=2048,
                            schedule=cfg.schedule, chunks=cfg.chunks)
            want, res = estimate_run(spec, HW, layout, feats)
            assert got.estimate == want and got.result.makespan == res.makespan
            assert isinstance(feats, Features)
