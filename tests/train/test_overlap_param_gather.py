"""The sharded optimizer's parameter all-gather overlapped with the next step's forward
(`overlap_param_gather`, `stp train --overlap-param-gather`; stp.train.step.param_gather).

In one process: the flag is a TrainJob field that reaches the Trainer's options,
off by default (the option refuses anything but a bool); a failed all-gather
surfaces when waited for as the one-line rank error every collective raises,
naming the action.

On pp2 x dp2 (float64, clipping and a cosine schedule active, the sharded
optimizer), on 1F1B and on ZB-V (rank 0 holds stages 0 and 3; stage 3's first
forward comes well after stage 0's): with the flag on, the losses, norms and
lrs of 3 steps and the parameters after them equal the flag off bit for bit,
and the one-process reference within 1e-9. After every step the all-gathers
are still in flight (the overlap is taken), and the model's own tensors are
not all updated yet: every reader (here `full_state_dict`) finishes them
first. In the ZB-V run's last step each stage's parameters are waited for
before its first forward starts, stage 3's only after stage 0's forwards
began, and the trace's dp lane holds each stage's all-gather (`DP-AG`) ending
before that forward; the written trace reads back and draws as `stp draw
--measured` does, the gathers in its summary. A checkpoint saved right after
a 1F1B step with the flag on holds the updated parameters: resumed, its next
step equals the continuous run bit for bit. With the flag off, or on without the sharded optimizer,
nothing is deferred and the executor has no hook.

Slow: on pp2 x dp2 every schedule, and ZB-V in bfloat16 (the fp32 masters
rounded into the packed shards), and the MoE model at dp4 with ep 2 (the
experts gathered over their expert-data-parallel pairs, a section of their
own), each with the flag on equals it off bit for bit over two steps.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_dist
from _train_common import (
    CONFIG,
    TOL,
    M,
    batch,
    optimizer,
    options,
    reference,
    train,
    worst,
    worst_param,
)
from test_moe_parity import CONFIG as MOE
from test_moe_parity import SEQ as MOE_SEQ

from stp.cli.flags import add_flags, from_args
from stp.runtime.errors import RankError
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.run.config import TrainJob
from stp.train.run.resolve import resolve
from stp.train.step.grad_sync import collective
from stp.train.step.param_gather import ParamGather
from stp.train.step.trainer import Trainer, TrainerOptions
from stp.train.step.zero import DPGroup, ShardedPrecision
from stp.viz.measured import measured_scene
from stp.viz.measured_read import load_measured_trace

STEPS, SAVE_AT = 3, 2
SCHEDULES = ("1f1b", "zb-v")


# -- one process ---------------------------------------------------------------------------


def test_the_flag_reaches_the_trainer_off_by_default() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainJob)
    args = ["--dp", "2", "--shard-optimizer", "--steps", "1"]
    plain = resolve(from_args(TrainJob, parser.parse_args(args)))
    on = resolve(from_args(TrainJob, parser.parse_args([*args, "--overlap-param-gather",
                                                        "on"])))
    assert on.job.overlap_param_gather and not plain.job.overlap_param_gather
    assert on.trainer_options().overlap_param_gather
    assert not plain.trainer_options().overlap_param_gather
    with pytest.raises(ValueError, match="overlap_param_gather must be True or False, got 'on'"):
        TrainerOptions(overlap_param_gather="on")


class _Where:
    def describe(self) -> str:
        return "global rank 1 (pp 0, tp 0, dp 1)"


class _LostPeer:
    """An all-gather whose peer went away: the backend's error comes with the wait."""

    def is_completed(self) -> bool:
        return False

    def get_future(self):
        raise RuntimeError("no future")

    def wait(self) -> None:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:4321\nmore lines")


def test_a_failed_gather_is_the_rank_error_of_every_collective() -> None:
    def run(action, peers, fn, *args, **kw):
        if fn is dist.all_gather_single:  # launched: fails only when waited for
            return _LostPeer()
        return collective(_Where(), action, peers, fn, *args, **kw)

    group = DPGroup(2, 1, None, run, "a rank in DP group [1, 3]")
    weight = torch.nn.Parameter(torch.ones(4, 2, dtype=torch.float64))
    gather = ParamGather(ShardedPrecision([("w", weight)], (), group), {0: [0]})
    gather.launch()
    assert gather.in_flight
    with pytest.raises(RankError) as err:
        gather.params_needed(0)
    text = str(err.value)
    assert "parameter all-gather" in text and "DP group [1, 3]" in text, text
    assert "global rank 1" in text and "\n" not in text, text


# -- pp2 x dp2 -----------------------------------------------------------------------------


def _trainer(mesh: Mesh, schedule: str, **kw) -> Trainer:
    return Trainer(CONFIG, optimizer(), registry.make(schedule, 2, M), mesh=mesh,
                   **options(**{"shard_optimizer": True, **kw}))


def _stale(trainer: Trainer) -> bool:
    """The model's own tensors (read past the Trainer) change when the all-gathers in
    flight are finished: they were not written yet."""
    before = [p.detach().clone() for _, p in trainer.parts.named_parameters()]
    trainer.finish_param_gather()
    after = [p.detach() for _, p in trainer.parts.named_parameters()]
    return not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _waits(trainer: Trainer) -> list[float]:
    """Record when the executor asks for each stage's parameters: (stage, time)."""
    calls: list = []
    asked = trainer.parts.executor.params_needed

    def recorded(stage: int) -> None:
        calls.append((stage, time.perf_counter()))
        asked(stage)

    trainer.parts.executor.params_needed = recorded
    return calls


def _order(trainer: Trainer, calls: list) -> dict:
    """Per stage of this rank in the last step: (asked once, before its first forward),
    (its DP-AG span ends before that forward), and when it was asked and its first
    forward started."""
    rec = trainer.parts.executor.recorder
    spans, out = rec.spans(), {}
    for stage in trainer.parts.stages:
        first_f = min(s.start for s in spans if s.lane == "compute" and s.kind == "F"
                      and s.stage == stage)
        asked = [t for s, t in calls if s == stage and t >= rec.origin]
        gathers = [s.end for s in spans if s.lane == "dp" and s.kind == "DP-AG"
                   and s.stage == stage]
        out[stage] = {"asked_once_before": len(asked) == 1 and asked[0] <= first_f,
                      "traced_before": bool(gathers) and max(gathers) <= first_f,
                      "asked": asked[0] if asked else None, "first_f": first_f}
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    mesh = Mesh.from_world(ParallelDims(2, 1, 2), timeout=60)
    out: dict = {"hookless": []}
    for schedule in SCHEDULES:
        off = _trainer(mesh, schedule)
        out["hookless"].append(off.parts.param_gather is None
                               and off.parts.executor.params_needed is None)
        stats_off = train(off, range(STEPS))
        params_off = off.full_state_dict()
        on = _trainer(mesh, schedule, overlap_param_gather=True, trace=True)
        calls, stats, in_flight = _waits(on), [], []
        for step in range(STEPS):
            stats += train(on, range(step, step + 1))
            in_flight.append(on.parts.param_gather.in_flight)
            if schedule == "1f1b" and step + 1 == SAVE_AT:
                on.save(f"{root}/{schedule}")  # right after the step, gathers in flight
        case = {"stats": stats, "same_stats": stats == stats_off, "in_flight": in_flight}
        if schedule == "zb-v":  # the last step waited for the all-gathers of the one before
            case["order"] = _order(on, calls)
            on.write_trace(f"{root}/trace.json")  # collective; rank 0 writes
        case["stale"] = _stale(on)
        params = on.full_state_dict()
        if params is not None:
            case["same_params"] = all(torch.equal(params[n], params_off[n]) for n in params)
            ref_stats, ref_params = reference(STEPS)
            case["ref"] = (worst(stats, ref_stats), worst_param(params, ref_params))
        if schedule == "1f1b":
            again = Trainer.resume(f"{root}/{schedule}", CONFIG, optimizer(),
                                   registry.make(schedule, 2, M), mesh=mesh,
                                   **options(shard_optimizer=True, overlap_param_gather=True))
            case["resumed_same"] = train(again, range(SAVE_AT, STEPS)) == stats[SAVE_AT:]
            resumed = again.full_state_dict()
            if resumed is not None:
                case["resumed_params"] = all(torch.equal(resumed[n], params[n])
                                             for n in params)
        out[schedule] = case
    unsharded = _trainer(mesh, "1f1b", shard_optimizer=False, overlap_param_gather=True)
    out["hookless"].append(unsharded.parts.param_gather is None
                           and unsharded.parts.executor.params_needed is None)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("gather"))
    out = run_dist(_worker, 4, root, timeout=600)
    out[0]["root"] = root
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_overlapped_gather_equals_the_gather_at_once_bit_for_bit(runs: list[dict],
                                                                 schedule: str) -> None:
    assert all(r[schedule]["same_stats"] for r in runs)
    assert runs[0][schedule]["same_params"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_overlapped_gather_equals_the_one_process_reference(runs: list[dict],
                                                            schedule: str) -> None:
    loss_error, param_error = runs[0][schedule]["ref"]
    assert loss_error <= TOL and param_error <= TOL, (loss_error, param_error)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_gathers_stay_in_flight_past_the_step_and_readers_finish_them(
        runs: list[dict], schedule: str) -> None:
    assert all(r[schedule]["in_flight"] == [True] * STEPS for r in runs)
    assert all(r[schedule]["stale"] for r in runs)


def test_each_stage_waits_for_its_parameters_just_before_its_first_forward(
        runs: list[dict]) -> None:
    for rank, r in enumerate(runs):
        order = r["zb-v"]["order"]
        assert all(o["asked_once_before"] and o["traced_before"] for o in order.values()), (
            rank, order)
    v = runs[0]["zb-v"]["order"]  # rank 0 holds stages 0 and 3
    assert v[3]["asked"] > v[0]["first_f"], v


def test_the_drawn_trace_shows_every_stage_gather_in_the_dp_lane(runs: list[dict]) -> None:
    trace = load_measured_trace(f"{runs[0]['root']}/trace.json")  # as `stp draw --measured`
    gathers = {(s.rank, s.stage) for s in trace.spans if s.lane == "dp" and s.kind == "DP-AG"}
    pp_of, held = ParallelDims(2, 1, 2).coord_of, registry.make("zb-v", 2, M).stages_of
    assert gathers == {(r, s) for r in range(4) for s in held(pp_of(r).pp)}, gathers
    text = [e.text for e in measured_scene(trace).items if hasattr(e, "text")]
    assert any(t.startswith("DP parameter all-gathers, all ranks") for t in text), text


def test_a_checkpoint_saved_with_gathers_in_flight_resumes_the_continuous_run(
        runs: list[dict]) -> None:
    assert all(r["1f1b"]["resumed_same"] for r in runs)
    assert runs[0]["1f1b"]["resumed_params"]


def test_nothing_is_deferred_with_the_flag_off_or_without_sharding(runs: list[dict]) -> None:
    assert all(all(r["hookless"]) for r in runs)


# -- slow: every schedule, bfloat16, experts -------------------------------------------------


def _same_runs(mesh: Mesh, make, steps: int, batch_of) -> bool:
    """Losses and parameters after `steps` steps equal with the flag on and off."""
    runs = []
    for on in (False, True):
        trainer = make(mesh, on)
        losses = [trainer.step(batch_of(step)) for step in range(steps)]
        runs.append((losses, trainer.full_state_dict()))
    (a, pa), (b, pb) = runs
    return a == b and (pa is None or all(torch.equal(pa[n], pb[n]) for n in pa))


def _slow_worker(rank: int, world: int) -> dict:
    pp2 = Mesh.from_world(ParallelDims(2, 1, 2), timeout=60)
    out = {}
    for name in registry.names():
        out[name] = _same_runs(pp2, lambda mesh, on, name=name: _trainer(
            mesh, name, overlap_param_gather=on), 2, batch)
    out["bf16"] = _same_runs(pp2, lambda mesh, on: _trainer(
        mesh, "zb-v", overlap_param_gather=on, dtype=torch.bfloat16, clip_grad=None),
        2, batch)
    dp4 = Mesh.from_world(ParallelDims(1, 1, 4, 2), timeout=60)

    def moe_batch(step: int):
        gen = torch.Generator().manual_seed(3000 + step)
        tok = torch.randint(0, MOE.vocab_size, (16, MOE_SEQ + 1), generator=gen)
        return tok[:, :-1], tok[:, 1:]

    out["moe"] = _same_runs(dp4, lambda mesh, on: Trainer(
        MOE, optimizer(), registry.make("1f1b", 1, 4), mesh=mesh,
        **options(shard_optimizer=True, overlap_param_gather=on)), 2, moe_batch)
    return out


@pytest.mark.slow
def test_every_schedule_bf16_and_experts_equal_the_gather_at_once() -> None:
    for got in run_dist(_slow_worker, 4, timeout=1800):
        assert all(got.values()), got
