"""Hangs become diagnoses: a rank that waits past the timeout names itself, the
action and the peer, and every rank exits (nothing blocks forever).

Only the pipeline transfers run under the short TIMEOUT: the rendezvous, the
groups and the setup use a long one and end in a barrier, so which receive
times out does not depend on how fast each process started (a loaded
machine starts one rank seconds after the other)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from _dist import DistFailure, run_dist
from test_executor_toy import HIDDEN, MBS, SEQ, ToyStage, _batch

from stp.runtime.errors import CommTimeout
from stp.runtime.executor import Executor
from stp.runtime.launch import launch_local
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.schedule.lower import LoweredSchedule, lower
from stp.schedule.registry import make as make_schedule
from stp.train.step.trainer import Trainer

TIMEOUT = 1.5
LATE = 2 * TIMEOUT
"""Rank 1 starts this much later than rank 0 (as on a loaded machine): the
diagnoses must not change."""
GIVE_UP = 30.0
"""Seconds after the barrier by which every rank must have failed: far below
the 60 s of the process groups and of run_dist's kill (a hang), far above
TIMEOUT plus the stall even on a loaded machine."""


def _after_barrier(run) -> None:
    """run() after a barrier; its error gets a note of how long it took."""
    dist.barrier()
    start = time.monotonic()
    try:
        run()
    except BaseException as e:
        e.add_note(f"failed {time.monotonic() - start:.2f} s after the barrier")
        raise


def _seconds_to_fail(errors: dict[int, str]) -> dict[int, float]:
    got = {r: re.search(r"failed ([0-9.]+) s after the barrier", text)
           for r, text in errors.items()}
    assert all(got.values()), errors
    return {r: float(m.group(1)) for r, m in got.items()}


def _lost_send(rank: int, world: int) -> None:
    """Rank 0's program loses its 0SEND_F0: rank 1 starves in 1RECV_F0, and
    rank 0 then starves in 0RECV_B0."""
    time.sleep(LATE if rank == 1 else 0.0)
    mesh = Mesh.from_world(ParallelDims(pp=2), timeout=30)
    sch = make_schedule("1f1b", 2, 2)
    low = lower(sch)
    progs = list(low.actions)
    progs[0] = tuple(a for a in progs[0] if str(a) != "0SEND_F0")
    broken = LoweredSchedule(sch, tuple(progs), low.lookahead)
    stages = {s: ToyStage(s, 2, 2) for s in sch.stages_of(rank)}
    # Rank 1 is the one to time out; rank 0 waits longer, so that rank 1 being
    # scheduled late after the barrier (a loaded machine) cannot swap the roles.
    timeout = TIMEOUT if rank == 1 else 4 * TIMEOUT
    p2p = P2P(mesh.pp_group, mesh.ranks["pp"], 2, timeout=timeout, where=mesh.describe())
    ex = Executor(broken, rank, stages, p2p, boundary_shape=(MBS, SEQ, HIDDEN),
                  dtype=torch.float64, where=mesh.describe())
    tokens, targets = _batch(2)
    # Both programs start together: rank 1's TIMEOUT runs from here.
    _after_barrier(lambda: ex.run(list(tokens.chunk(2)), list(targets.chunk(2))))


def test_lost_send_names_rank_action_and_peer():
    with pytest.raises(DistFailure) as info:
        run_dist(_lost_send, 2, timeout=120)
    errors = info.value.errors
    assert max(_seconds_to_fail(errors).values()) < GIVE_UP
    assert set(errors) == {0, 1}
    assert "CommTimeout" in errors[1]
    assert "rank 1 (pp 1, tp 0, dp 0) in 1RECV_F0 before 1F0" in errors[1]
    assert "pipeline rank 0 (global rank 0, stage 0)" in errors[1]
    # Rank 0 either starves in its own receive or finds the pair already closed.
    assert "rank 0 (pp 0, tp 0, dp 0) in 0RECV_B" in errors[0]
    assert "pipeline rank 1 (global rank 1, stage 1)" in errors[0]


class _SlowStage(ToyStage):
    """Stalls `delay` seconds in the forward of microbatch 1 (a stuck GPU, a slow node)."""

    delay = 0.0

    def forward(self, mb, x, targets=None):
        if mb == 1:
            time.sleep(self.delay)
        return super().forward(mb, x, targets)


def _stalled_rank(rank: int, world: int) -> None:
    def build(stage, num_stages, **kw):
        st = _SlowStage(stage, num_stages, 2 * num_stages)
        st.delay = 4 * TIMEOUT if rank == 0 else 0.0
        return st

    time.sleep(LATE if rank == 1 else 0.0)
    # The groups with a long timeout (built while the other rank may still be
    # starting), the pipeline transfers with TIMEOUT.
    mesh = Mesh.from_world(ParallelDims(pp=2), timeout=60)
    trainer = Trainer(build, lambda ps: torch.optim.SGD(ps, lr=0.1), "1f1b", mesh=mesh,
                      microbatches=2, hidden=HIDDEN, dtype=torch.float64, timeout=TIMEOUT)
    _after_barrier(lambda: trainer.step(_batch(2)))


def test_stalled_rank_every_rank_exits_with_a_diagnosis():
    with pytest.raises(DistFailure) as info:
        run_dist(_stalled_rank, 2, timeout=120)
    errors = info.value.errors
    assert max(_seconds_to_fail(errors).values()) < GIVE_UP
    assert set(errors) == {0, 1}, "every rank must report, none may hang"
    assert "CommTimeout" in errors[1] and "1RECV_F1 before 1F1" in errors[1]
    assert "waited more than 1.5 s for data from pipeline rank 0" in errors[1]
    assert "rank 0 (pp 0, tp 0, dp 0)" in errors[0]
    assert "pipeline rank 1" in errors[0] or "the world" in errors[0]


def _exit_or_sleep(code: int) -> int:
    if os.environ["RANK"] == "1":
        os._exit(code)
    time.sleep(600)
    return 0


def test_local_launch_stops_every_worker_when_one_fails():
    start = time.monotonic()
    result = launch_local(_exit_or_sleep, (3,), 2)
    # Well before the sleeper's 600 s, with room for a slow start on a loaded machine.
    assert time.monotonic() - start < 300
    assert result.exitcode == 3 and result.failed_ranks == [1]


def test_comm_timeout_is_a_rank_error():
    err = CommTimeout("waited", where="rank 2 (pp 1, tp 0, dp 0)", action="2RECV_F3")
    assert str(err) == "rank 2 (pp 1, tp 0, dp 0) in 2RECV_F3: waited"
