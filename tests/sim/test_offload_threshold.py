"""The offload rules at their thresholds, on the plan and on what the runtime moves.

Two rules decide whether a forward's activations leave the device:

- `stp.schedule.offload.plan_chunks` (policies `stp` and `all`): the reload is
  issued `ahead` actions before the backward, and a pass is offloaded only when
  that reload comes after its forward, i.e. when its backward is at least
  `ahead + 1` actions after its forward on the rank's list.
- `stp.sim.offload` (policy `selective:X`, PipeOffload, arXiv 2503.01328): an
  activation is a candidate only when it lives (end of F to start of B, simulated
  without offload) at least three round trips of its copy, `3 x 2 x copy_time`.

Each rule is checked with one activation exactly at its threshold (offloaded) and
one just below (kept), on hand-written one-rank schedules whose positions and
simulated lifetimes are counted by hand below, and then run by the executor with
a real stage: the bytes the offloader copied to the host are exactly the bytes
the planned forwards kept, and no other forward's.
"""

from __future__ import annotations

import pytest
import torch

from stp.models import ModelConfig, StagePlacement, build_stage
from stp.runtime.executor import Executor
from stp.runtime.offload import ActivationOffloader, runtime_plan
from stp.schedule import validate
from stp.schedule.io import from_rows
from stp.schedule.ir import Kind, Pass, Schedule
from stp.schedule.lower import lower
from stp.schedule.offload import plan_chunks
from stp.sim import Costs, MemCosts, OffloadCosts, simulate
from stp.sim.offload import plan_offload

# One stage on one rank; I is the input-gradient backward, W the weight gradient.
# Positions: F0@0 F1@1 I1@2 W1@3 F2@4 F3@5 I2@6 I3@7 I0@8 ...
# backward minus forward: mb1 1 (= ahead: kept), mb2 2 and mb3 2 (= ahead + 1:
# offloaded, the reload right after the forward), mb0 8.
GAPS = from_rows([["0F0", "0F1", "0I1", "0W1", "0F2", "0F3", "0I2", "0I3", "0I0",
                   "0W2", "0W3", "0W0"]])

# Positions: F0@0 F2@1 F1@2 F3@3 I3@4 I2@5 W3@6 I0@7 I1@8 ...
# Every action takes 1 at the simulator's default costs (f = b = w = 1, one
# chunk), so a forward at position p ends at p + 1 and a backward at q starts at
# q: lifetimes mb0 7-1 = 6, mb1 8-3 = 5, mb2 5-2 = 3, mb3 4-4 = 0.
LIVES = from_rows([["0F0", "0F2", "0F1", "0F3", "0I3", "0I2", "0W3", "0I0", "0I1",
                    "0W2", "0W0", "0W1"]])
LIFETIMES = {0: 6, 1: 5, 2: 3, 3: 0}

CONFIG = ModelConfig(vocab_size=32, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     ffn_hidden=64, max_seq_len=8, seed=5)
MBS, SEQ = 2, 8


def _mbs(reload_at: dict[tuple[int, int], int]) -> set[int]:
    return {mb for _, mb in reload_at}


def test_hand_schedules_are_valid_and_lifetimes_are_as_counted() -> None:
    """The references of the tests below: both schedules pass the validator, and the
    simulator's lifetimes are the hand count (guards against a threshold test that
    passes because its activation is not where the test thinks it is)."""
    for sch in (GAPS, LIVES):
        validate(sch)
    res = simulate(LIVES, Costs(), MemCosts(), record_spans=True)
    f_end = {sp.mb: sp.end for sp in res.spans if sp.lane == "compute" and sp.kind == "F"}
    b_start = {sp.mb: sp.start for sp in reversed(res.spans)
               if sp.lane == "compute" and sp.kind == "B"}
    assert {mb: b_start[mb] - f_end[mb] for mb in f_end} == LIFETIMES


def test_plan_chunks_offloads_a_backward_ahead_plus_one_actions_away_not_ahead() -> None:
    """Guards against `reload_at > f_at` turned into `>=` (or `b_at - ahead - 1`):
    a pass whose reload would be issued at its own forward's position gains
    nothing and must stay resident; one action later it is offloaded."""
    assert plan_chunks(GAPS, None).reload_at == {(0, 0): 7, (0, 2): 5, (0, 3): 6}
    # ahead = 2: the threshold moves to 3 actions; mb2 and mb3 (2 away) now stay
    assert plan_chunks(GAPS, None, ahead=2).reload_at == {(0, 0): 6}
    assert _mbs(runtime_plan(GAPS, "all").reload_at) == {0, 2, 3}


def test_selective_offloads_an_activation_living_exactly_three_round_trips() -> None:
    """Guards against `lifetime >= 3 * round_trip` turned into `>` in
    stp.sim.offload: at costs f = b = w = 6 mb2 lives 18 (3 x 6); a copy of one
    M_B taking 3 (act_bytes 3, bandwidth 1) makes a round trip 6, so mb2 is exactly
    at the threshold and offloaded (with it the bisection takes mb1, the longer
    lived, whose copy alone did not lower the peak). A hair slower link and mb2
    is just below it and kept."""
    costs, mem = Costs(f=6, b=6, w=6), MemCosts()
    at = plan_offload(LIVES, "selective:0.99", costs, mem, OffloadCosts(1.0, act_bytes=3.0))
    assert _mbs(at.reload_at) == {0, 1, 2}
    above = plan_offload(LIVES, "selective:0.99", costs, mem,
                         OffloadCosts(1.0, act_bytes=3.0000001))
    assert _mbs(above.reload_at) == {0}
    # the runtime plans with the default costs: a round trip of 2, threshold 6;
    # mb0 lives 6 (offloaded), mb1 5 (kept, although `all` would move it)
    assert _mbs(runtime_plan(LIVES, "selective:0.9").reload_at) == {0}
    assert {0, 1} <= _mbs(runtime_plan(LIVES, "all").reload_at)


def test_selective_stops_at_the_first_prefix_that_meets_the_target_exactly() -> None:
    """Guards against `peak_with(mid) <= target` turned into `<`: at f = b = w = 6
    and a copy of 3 the peak of 4 M_B falls to 3 with mb0 out (3 = 4 x (1 - 0.25)
    exactly), so selective:0.25 offloads mb0 alone; a strict comparison would
    take every candidate down to the peak of 2."""
    costs, mem, oc = Costs(f=6, b=6, w=6), MemCosts(), OffloadCosts(1.0, act_bytes=3.0)
    assert max(simulate(LIVES, costs, mem).peak_activation) == 4.0
    plan = plan_offload(LIVES, "selective:0.25", costs, mem, oc)
    assert _mbs(plan.reload_at) == {0}
    res = simulate(LIVES, costs, mem, offload=plan, offload_costs=oc)
    assert max(res.peak_activation) == 3.0


def _run(sch: Schedule, policy: str) -> tuple[ActivationOffloader, dict[int, int]]:
    """One step of `sch` on one rank with a real stage, offloading by `policy`; with
    the bytes copied to the host right after each microbatch's forward."""
    stages = {0: build_stage(CONFIG, StagePlacement(0, 1, dtype=torch.float32))}
    off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, policy))
    copied: dict[int, int] = {}
    after = off.after_pass

    def watch(p: Pass) -> None:
        before = off.memory.offloaded_bytes
        after(p)
        if p.kind is Kind.F:
            copied[p.mb] = off.memory.offloaded_bytes - before

    off.after_pass = watch  # type: ignore[method-assign]
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, CONFIG.hidden),
                  dtype=torch.float32, offload=off)
    tok = torch.randint(0, CONFIG.vocab_size, (4 * MBS, SEQ + 1),
                        generator=torch.Generator().manual_seed(3))
    ex.run(list(tok[:, :-1].chunk(4)), list(tok[:, 1:].chunk(4)))
    return off, copied


@pytest.mark.parametrize("sch,policy,moved", [
    (GAPS, "all", {0, 2, 3}),         # mb1's backward is `ahead` actions away: kept
    (LIVES, "selective:0.9", {0}),    # mb0 lives exactly 3 round trips, mb1 one less
])
def test_the_runtime_moves_exactly_the_planned_forwards(
    sch: Schedule, policy: str, moved: set[int]
) -> None:
    """Right after each forward the offloader copies to the host all the bytes that
    forward kept when it is at or over the threshold, and nothing when it is below;
    every activation is back on the device at the end of the step. Guards against
    either comparison flipped (`>=` in plan_chunks moves mb1 too; `>` in the
    selective rule moves nothing) as the runtime runs it (runtime_plan)."""
    off, copied = _run(sch, policy)
    kept = off.memory.forward_bytes
    assert set(kept) == {(0, mb) for mb in range(4)} and min(kept.values()) > 0
    assert copied == {mb: kept[(0, mb)] if mb in moved else 0 for mb in range(4)}
    assert off.memory.offloaded_bytes == sum(copied.values())
    assert off.resident_bytes() == 0 == off.recount()
