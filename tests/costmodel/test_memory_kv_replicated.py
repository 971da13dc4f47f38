"""The memory model with fewer kv heads than TP ranks, against the stages stp builds.

With num_kv_heads < tp each kv head is replicated on tp / num_kv_heads ranks
(stp.models.decoder.init.tp_slice, as Megatron-LM does): every TP rank holds one
whole kv head of K and V, not kv_heads / tp of one. `stp.costmodel.memory` prices
that (`_layer_parameters`: max(kv_heads // t, 1) heads a rank). The reference
here is what the runtime really holds: every TP rank's stages built at the
layout's partition, and the bytes `stp.train.run.memory_measure.measure` counts
(by storage) of their parameters, the fp32 main grads and masters of
stp.train.step.precision and a torch AdamW's state after one step (its step
counters, which the model leaves out, subtracted); and the activations a layer
keeps, `stp.costmodel.decoder.kept`, against stp.runtime.offload's census of a TP rank's
forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from stp.costmodel import HARDWARE
from stp.costmodel.configs import spec_from_config
from stp.costmodel.decoder.kept import stp_kept
from stp.costmodel.memory import Features, Layout, estimate
from stp.models import ModelConfig, StagePlacement, build_stage
from stp.models.moe.stage import build_moe_stage
from stp.runtime.executor import Executor
from stp.runtime.offload import ActivationOffloader, runtime_plan
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule
from stp.shapes import MoEConfig
from stp.train.run.memory_measure import measure
from stp.train.step.precision import Precision

PP, SEQ, MBS = 2, 16, 2


def _dense(kv: int) -> ModelConfig:
    # an odd vocabulary (padded to a multiple of tp) and 3 layers (stages of 2 and 1)
    return ModelConfig(vocab_size=81, hidden=64, num_layers=3, num_heads=4, num_kv_heads=kv,
                       ffn_hidden=128, max_seq_len=SEQ, seed=1)


def _moe(kv: int) -> MoEConfig:
    return MoEConfig(vocab_size=81, hidden=64, num_layers=3, num_heads=4, num_kv_heads=kv,
                     ffn_hidden=128, max_seq_len=SEQ, seed=1, num_experts=4, top_k=2,
                     expert_ffn=32, shared_expert_ffn=32)


@dataclass
class _Held:
    """What memory_measure.measure reads of a Trainer: the parameters, the precision
    and the optimizer."""

    named: list[tuple[str, torch.nn.Parameter]]
    precision: Precision
    optimizer: torch.optim.Optimizer

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.named

    @property
    def parts(self) -> _Held:
        """measure reads the precision as a Trainer holds it: trainer.parts.precision."""
        return self


def _stages(cfg: ModelConfig, tp: int, rank: int, dtype: torch.dtype,
            monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Pipeline rank `rank`'s stage (1f1b: one a rank) on every TP rank."""
    if isinstance(cfg, MoEConfig):
        # build_moe_stage asks for a process group before it builds its all-reduce,
        # which building never calls: the shards are what is measured here
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        return [build_moe_stage(cfg, StagePlacement(rank, PP, tp_size=tp, tp_rank=t, dtype=dtype))
                for t in range(tp)]
    return [build_stage(cfg, StagePlacement(rank, PP, tp_size=tp, tp_rank=t, dtype=dtype),
                        allreduce=lambda a: a) for t in range(tp)]


def _measured(stage: Any) -> dict[str, int]:
    named = list(stage.named_parameters())
    precision = Precision(named)
    optimizer = torch.optim.AdamW(precision.params)
    precision.grads()  # zeros: one step creates the state
    optimizer.step()
    held = measure(_Held(named, precision, optimizer), None)
    steps = sum(s["step"].untyped_storage().nbytes() for s in optimizer.state.values())
    return {**held, "optimizer": held["optimizer"] - steps,
            "parameters": sum(p.numel() for _, p in named)}


@pytest.mark.parametrize("make,tp,kv", [
    (_dense, 4, 2),   # each kv head on 2 ranks
    (_dense, 2, 1),   # the one kv head on both ranks
    (_moe, 4, 1),     # a mixture of experts: the router whole on every rank too
])
@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"),
                                        (torch.float32, "float32")])
def test_model_states_are_the_shards_the_runtime_builds(
    make: Any, tp: int, kv: int, dtype: torch.dtype, name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guards against kv heads divided instead of replicated (kv_heads / t of a head
    a rank, or 0 with integer division) in stp.costmodel.memory: the parameters,
    weights, grads, masters and optimizer bytes of every pipeline rank equal what
    each TP rank of its stage holds."""
    cfg = make(kv)
    assert cfg.num_kv_heads < tp and cfg.kv_replicas(tp) == tp // kv
    layout = Layout(pp=PP, tp=tp, microbatches=2, microbatch_size=1, seq_len=SEQ,
                    schedule="1f1b")
    est = estimate(cfg, HARDWARE["a100-80g"], layout, Features(dtype=name, runtime="stp"))
    for rank in range(PP):
        got = [_measured(stage) for stage in _stages(cfg, tp, rank, dtype, monkeypatch)]
        assert all(g == got[0] for g in got), "TP ranks hold the same bytes"
        want = est.ranks[rank]
        assert want.parameters == got[0]["parameters"], rank
        for key in ("weights", "grads", "masters", "optimizer"):
            assert getattr(want, key) == got[0][key], (rank, key)


def test_the_kv_shard_is_one_whole_head_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference itself: at tp 4 with 2 kv heads a rank's K holds head_dim rows
    (one head), the same head on ranks 0 and 1 and the other on ranks 2 and 3.
    Guards against the runtime's kv slice (stp.models.decoder.init.tp_slice) picking
    heads round-robin or splitting a head, which the byte counts above cannot see."""
    cfg = _dense(2)
    stages = _stages(cfg, 4, 0, torch.float32, monkeypatch)
    wk = [dict(s.named_parameters())["layers.0.attn.wk.weight"] for s in stages]
    assert [tuple(w.shape) for w in wk] == [(cfg.head_dim, cfg.hidden)] * 4
    assert torch.equal(wk[0], wk[1]) and torch.equal(wk[2], wk[3])
    assert not torch.equal(wk[0], wk[2])


def _census(cfg: ModelConfig, tp: int, dtype: torch.dtype) -> tuple[int, int]:
    """What microbatch 0 keeps on stage 0 of zb-v on one pipeline rank, TP rank 0 of
    `tp`, from F to B and from B to W (stp.runtime.offload's census). One process:
    the all-reduces are the identity, so the values are not the model's, but every
    tensor a TP rank keeps has its real shape, which is all the census counts."""
    sch = make_schedule("zb-v", 1, 1)
    stages = {s: build_stage(cfg, StagePlacement(s, 2, dtype=dtype, tp_size=tp, tp_rank=0),
                             allreduce=lambda a: a) for s in (0, 1)}
    off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, "none"))
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, cfg.hidden),
                  dtype=dtype, offload=off)
    tok = torch.randint(0, cfg.vocab_size, (MBS, SEQ + 1),
                        generator=torch.Generator().manual_seed(0))
    ex.run([tok[:, :-1]], [tok[:, 1:]])
    return off.memory.forward_bytes[(0, 0)], off.memory.weight_bytes[(0, 0)]


@pytest.mark.parametrize("tp,kv", [(4, 2), (2, 1)])
def test_kept_activations_of_a_layer_hold_one_whole_kv_head(tp: int, kv: int) -> None:
    """Guards against kv heads divided instead of replicated in stp.costmodel.decoder.kept
    (the activations' side: K and V of one kv head a rank, kept F to B and B to W):
    one more layer a stage adds the census's bytes, both F to B and B to W."""
    two, four = (_census(dataclasses.replace(_dense(kv), num_layers=n), tp, torch.bfloat16)
                 for n in (2, 4))
    spec = spec_from_config(_dense(kv), seq_len=SEQ, microbatch_size=MBS, tp=tp)
    kept = stp_kept(spec, 2)
    assert (four[0] - two[0], four[1] - two[1]) == (kept.layer_b, kept.layer_w)
