"""Model stages against the single-process reference (float64, parity to 1e-9 of each
gradient's magnitude): pp cuts, the split backward, deferred W, TP shards (one
process with the ranks in lockstep through the unit API, and two gloo
processes through the real collectives, with two passes braided unit by unit)."""

from __future__ import annotations

import functools
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as hs

from stp.models import ModelConfig, ModelStage, StagePlacement, build_reference, build_stage
from stp.models.tp import start_allreduce
from stp.runtime.stage_api import PipelineStage
from stp.schedule.placement import stage_layers

D = torch.float64
CFG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=7,
)
SCALE = 0.5  # the executor's loss scale, e.g. 1 / num_microbatches
TOL = 1e-9


def batch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + mb)
    return torch.randint(0, CFG.vocab_size, (2, 8), generator=g), torch.randint(
        0, CFG.vocab_size, (2, 8), generator=g
    )


@functools.cache
def reference(num_mbs: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-microbatch losses and the gradients of SCALE * sum of them."""
    ref = build_reference(CFG, D)
    losses = []
    for mb in range(num_mbs):
        loss = ref.loss(*batch(mb))
        (SCALE * loss).backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in ref.named_parameters()}


def assert_grads_match(stage: ModelStage, grads: dict[str, torch.Tensor], tp: int, rank: int):
    for name, p in stage.named_parameters():
        full = grads[name]
        dim = stage.shard_dim(name)
        want = full if dim is None else full.chunk(tp, dim)[rank]
        assert p.grad is not None, name
        err = (p.grad - want).abs().max().item()
        assert err <= TOL * full.abs().max().item(), (name, err)


def run_pipeline(stages: list[ModelStage], num_mbs: int, mode: str) -> list[float]:
    """Forward every microbatch stage by stage, then the backward in reverse:
    'B+W' (W right after each B), 'BW' (backward_full), 'deferred' (all B, then all W)."""
    losses = []
    for mb in range(num_mbs):
        x, targets = batch(mb)
        for st in stages:
            x = st.forward(mb, x, targets if st.is_last else None)
        losses.append(x.item())
    for mb in range(num_mbs):
        g = None
        for st in reversed(stages):
            if mode == "BW":
                g = st.backward_full(mb, g, SCALE)
            else:
                g = st.backward_input(mb, g, SCALE)
                if mode == "B+W":
                    st.backward_weight(mb)
        assert g is None
    if mode == "deferred":
        assert all(st.pending_weight() == list(range(num_mbs)) for st in stages)
        for mb in range(num_mbs):
            for st in reversed(stages):
                st.backward_weight(mb)
    return losses


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("mode", ["B+W", "BW", "deferred"])
def test_stages_match_reference(num_stages: int, mode: str):
    stages = [build_stage(CFG, StagePlacement(s, num_stages, dtype=D)) for s in range(num_stages)]
    assert all(isinstance(st, PipelineStage) for st in stages)
    losses = run_pipeline(stages, 2, mode)
    ref_losses, grads = reference(2)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for st in stages:
        assert_grads_match(st, grads, 1, 0)
        assert st.pending_backward() == [] and st.pending_weight() == []


def test_backward_input_touches_no_grad_and_backward_full_equals_b_then_w():
    x, targets = batch(0)
    split, full = (build_stage(CFG, StagePlacement(0, 1, dtype=D)) for _ in range(2))
    for st in (split, full):
        st.forward(0, x, targets)
    assert split.backward_input(0, None, SCALE) is None
    assert all(p.grad is None for p in split.parameters()), "B must defer every weight gradient"
    assert split.pending_weight() == [0]
    split.backward_weight(0)
    full.backward_full(0, None, SCALE)
    for (name, a), (_, b) in zip(split.named_parameters(), full.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_input_buffer_may_be_reused_after_forward():
    """The executor may recycle a receive buffer once forward returns (ModelStage doc)."""
    x, targets = batch(0)
    first, last = (build_stage(CFG, StagePlacement(s, 2, dtype=D)) for s in range(2))
    hidden = first.forward(0, x)
    received = hidden.clone()
    last.forward(0, received, targets)
    received.fill_(float("nan"))
    first.backward_full(0, last.backward_full(0, None, SCALE), SCALE)
    _, grads = reference(1)
    for stage in (first, last):
        assert_grads_match(stage, grads, 1, 0)


def test_float32_stage_tracks_reference():
    x, targets = batch(0)
    st = build_stage(CFG, StagePlacement(0, 1))
    loss = st.forward(0, x, targets)
    st.backward_full(0, None, 1.0)
    ref = build_reference(CFG)
    ref_loss = ref.loss(x, targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for name, p in st.named_parameters():
        r = dict(ref.named_parameters())[name].grad
        assert (p.grad - r).abs().max() <= 1e-4 * r.abs().max(), name


# -- TP in one process: the ranks in lockstep through the unit API ---------------


def lockstep(ranks: list[ModelStage], mb: int, x, targets, backward: bool):
    """One pass of one stage on every TP rank; the all-reduce is the sum of partials."""
    xs = list(x) if isinstance(x, list) else [x] * len(ranks)
    units = range(len(ranks[0].units))
    for k in reversed(units) if backward else units:
        us = [r.units[k] for r in ranks]
        if backward:
            parts = [u.backward_partial(mb, xi) for u, xi in zip(us, xs, strict=True)]
            red = None if parts[0] is None else sum(parts)
            xs = [u.backward_finish(mb, None if red is None else red.clone()) for u in us]
        else:
            last = k == len(units) - 1 and ranks[0].is_last
            tgt = targets if last else None
            parts = [u.forward_partial(mb, xi, tgt) for u, xi in zip(us, xs, strict=True)]
            red = sum(parts)
            xs = [u.forward_finish(mb, red.clone()) for u in us]
    return xs


def test_tp2_in_lockstep_matches_reference_slices():
    tp, num_stages = 2, 2
    grid = [[build_stage(CFG, StagePlacement(s, num_stages, tp_size=tp, tp_rank=t, dtype=D),
                         allreduce=lambda a: a)
             for t in range(tp)] for s in range(num_stages)]
    losses = []
    for mb in range(2):
        x, targets = batch(mb)
        for ranks in grid:
            x = lockstep(ranks, mb, x, targets, backward=False)
        assert x[0].item() == x[1].item()
        losses.append(x[0].item())
    for mb in range(2):
        g = [torch.tensor(SCALE, dtype=D)] * tp
        for ranks in reversed(grid):
            g = lockstep(ranks, mb, g, None, backward=True)
    for mb in range(2):  # W deferred past both microbatches' B
        for ranks in grid:
            for st in ranks:
                st.backward_weight(mb)
    ref_losses, grads = reference(2)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for ranks in grid:
        for t, st in enumerate(ranks):
            assert_grads_match(st, grads, tp, t)


# -- TP over gloo: two processes ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, timeout: float = 60.0) -> None:
    """Run fn(rank, port, nprocs) in nprocs processes; fail (not hang) on a deadlock."""
    port = _free_port()
    ctx = mp.start_processes(
        fn, args=(port, nprocs), nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"workers did not finish in {timeout}s")


def _braided_step(stage: ModelStage, mb_f: int, mb_b: int, group) -> torch.Tensor:
    """F of mb_f braided with B of mb_b, one unit of each at a time, each all-reduce in
    flight while the other pass computes (STP paper arXiv 2510.27257, Fig. 3)."""
    x, targets = batch(mb_f)
    g: torch.Tensor | None = torch.tensor(SCALE, dtype=D)
    units = stage.units
    for i in range(len(units)):
        uf, ub = units[i], units[len(units) - 1 - i]
        f_part = uf.forward_partial(mb_f, x, targets if uf is units[-1] else None)
        f_ar = start_allreduce(f_part, group, 2)
        b_part = ub.backward_partial(mb_b, g)
        b_ar = None if b_part is None else start_allreduce(b_part, group, 2)
        x = uf.forward_finish(mb_f, f_ar.wait())
        g = ub.backward_finish(mb_b, None if b_ar is None else b_ar.wait())
    assert g is None
    return x


def _tp_worker(rank: int, port: int, world: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # two processes on a 2-core runner: no oversubscription
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        group = dist.new_group([0, 1])
        ref_losses, grads = reference(2)
        # Stage-level protocol, pp=2 x tp=2, with W deferred past both B.
        stages = [build_stage(CFG, StagePlacement(s, 2, tp_group=group, tp_size=2, tp_rank=rank,
                                                  dtype=D))
                  for s in range(2)]
        losses = run_pipeline(stages, 2, "deferred")
        assert losses == pytest.approx(ref_losses, rel=1e-12), (losses, ref_losses)
        for st in stages:
            assert_grads_match(st, grads, 2, rank)
        # Braided units, pp=1: F0 alone, then F1 braided with B0, then B1, then W0, W1.
        whole = build_stage(CFG, StagePlacement(0, 1, tp_group=group, tp_size=2, tp_rank=rank,
                                                dtype=D))
        x0, t0 = batch(0)
        loss0 = whole.forward(0, x0, t0)
        loss1 = _braided_step(whole, 1, 0, group)
        whole.backward_input(1, None, SCALE)
        whole.backward_weight(0)
        whole.backward_weight(1)
        assert [loss0.item(), loss1.item()] == pytest.approx(ref_losses, rel=1e-12)
        assert_grads_match(whole, grads, 2, rank)
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_matches_reference_slices_and_braids():
    spawn(_tp_worker, 2)


# -- layer split, init independence, names -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(hs.integers(1, 40).flatmap(lambda n: hs.tuples(hs.just(n), hs.integers(1, n))))
def test_layer_split_is_contiguous_with_extra_layers_first(case: tuple[int, int]):
    num_layers, num_stages = case
    parts = [stage_layers(num_layers, s, num_stages) for s in range(num_stages)]
    assert [i for p in parts for i in p] == list(range(num_layers))
    sizes = [len(p) for p in parts]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_stages,tp", [(1, 1), (2, 2), (3, 2), (4, 4), (2, 8)])
def test_init_is_mesh_independent(num_stages: int, tp: int):
    cfg = ModelConfig(vocab_size=64, hidden=64, num_layers=4, num_heads=8, num_kv_heads=8, seed=3)
    ref = dict(build_reference(cfg, D).named_parameters())
    seen: list[str] = []
    for s in range(num_stages):
        for t in range(tp):
            st = build_stage(cfg, StagePlacement(s, num_stages, tp_size=tp, tp_rank=t, dtype=D),
                             allreduce=lambda a: a)
            names = [n for n, _ in st.named_parameters()]
            if t == 0:
                seen += names
            for name, p in st.named_parameters():
                dim = st.shard_dim(name)
                want = ref[name] if dim is None else ref[name].chunk(tp, dim)[t]
                assert torch.equal(p.detach(), want.detach()), (name, s, t)
    assert seen == list(ref), "stages hold every parameter exactly once, in model order"


def test_shard_dims_follow_megatron():
    st = build_stage(CFG, StagePlacement(0, 1))
    dims = {n: st.shard_dim(n) for n, _ in st.named_parameters()}
    assert dims["embed.weight"] == 0 and dims["head.weight"] == 0
    assert dims["layers.1.attn.wq.weight"] == 0 and dims["layers.1.attn.wo.weight"] == 1
    assert dims["layers.1.mlp.w1.weight"] == 0 and dims["layers.1.mlp.w2.weight"] == 1
    assert dims["norm.weight"] is None and dims["layers.0.attn_norm.weight"] is None
    with pytest.raises(ValueError, match="layers.9"):
        st.shard_dim("layers.9.attn.wq.weight")


# -- errors for people (config and build arguments: test_model_config_errors.py) ----


def test_wrong_inputs_raise_value_error():
    first, last = (build_stage(CFG, StagePlacement(s, 2, dtype=D)) for s in range(2))
    ids, targets = batch(0)
    with pytest.raises(ValueError, match="token ids"):
        first.forward(0, torch.zeros(2, 8, CFG.hidden, dtype=D))
    with pytest.raises(ValueError, match=r"vocab_size=32"):
        first.forward(0, ids + CFG.vocab_size)
    with pytest.raises(ValueError, match="not the last stage"):
        first.forward(0, ids, targets)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        first.forward(0, torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="needs targets"):
        last.forward(0, torch.zeros(2, 8, CFG.hidden, dtype=D))
    with pytest.raises(ValueError, match=r"\[batch, seq, 32\]"):
        last.forward(0, ids, targets)


def test_passes_out_of_order_raise_and_state_is_freed():
    st = build_stage(CFG, StagePlacement(0, 2, dtype=D))
    ids, _ = batch(0)
    with pytest.raises(RuntimeError, match="microbatch 0"):
        st.backward_input(0, torch.ones(2, 8, CFG.hidden, dtype=D))
    y = st.forward(0, ids)
    with pytest.raises(RuntimeError, match="microbatch 0"):
        st.forward(0, ids)
    assert st.pending_backward() == [0]
    with pytest.raises(RuntimeError, match="before its backward"):
        st.backward_weight(0)
    with pytest.raises(ValueError, match="output gradient"):
        st.backward_input(0, None)
    st.backward_input(0, torch.ones_like(y))
    assert st.pending_backward() == [] and st.pending_weight() == [0]
    st.backward_weight(0)
    assert st.pending_weight() == []
    assert all(not u._states and not u._wgrad.pending() for u in st.units)
    with pytest.raises(RuntimeError, match="no pending weight"):
        st.backward_weight(0)
    st.forward(1, ids)
    st.reset()
    assert st.pending_backward() == [] and st.pending_weight() == []


# -- broken variants: bugs planted in the stages must fail the parity checks above ----


def _eps_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    import stp.models.decoder.kernels as decoder  # the units' eager kernels call it

    plain = decoder.rms_norm
    monkeypatch.setattr(decoder, "rms_norm", lambda x, w, eps, sink: plain(x, w, 0.0, sink))


def _rope_turned_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import stp.models.decoder.kernels as decoder  # the units' eager kernels call it

    def backwards(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([x2, -x1], dim=-1) * sin

    monkeypatch.setattr(decoder, "apply_rope", backwards)


def _loss_scale_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = ModelStage.backward_input
    monkeypatch.setattr(ModelStage, "backward_input",
                        lambda self, mb, grad, scale=1.0: plain(self, mb, grad, 1.0))


def _every_rank_holds_rank_0s_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    import stp.models.decoder.init as init

    plain = init.tp_slice
    monkeypatch.setattr(init, "tp_slice", lambda c, spec, size, rank: plain(c, spec, size, 0))


def _stages_parity() -> None:
    test_stages_match_reference(2, "deferred")


STAGE_BUGS = {
    "RMSNorm eps dropped": (_eps_dropped, _stages_parity),
    "rotary turn reversed": (_rope_turned_back, _stages_parity),
    "loss scale dropped in B": (_loss_scale_dropped, _stages_parity),
    "TP ranks share one shard": (_every_rank_holds_rank_0s_shard,
                                 test_tp2_in_lockstep_matches_reference_slices),
}


@pytest.mark.parametrize("bug", STAGE_BUGS)
def test_planted_bug_fails_stage_parity(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, check = STAGE_BUGS[bug]
    check()  # the check holds on the code as it is ...
    reference(2)  # (the reference is computed, and cached, without the bug)
    plant(monkeypatch)
    with pytest.raises(AssertionError):  # ... and reports the planted bug
        check()
