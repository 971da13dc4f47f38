"""The parts behind `stp train`'s fault handling, one by one: diagnoses, error
classes, heartbeats, the signal watcher, the local launcher, the nodes' settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import DistFailure, run_dist

from stp.cli.train_supervise import StepTracker, shared_settings
from stp.runtime.agree import first_difference
from stp.runtime.errors import (
    EXIT_FAILED,
    EXIT_PEER,
    CommTimeout,
    PeerLost,
    RankError,
    exit_status,
    failure_kind,
    first_line,
    wrap,
)
from stp.runtime.launch import WorkerExit, diagnose, launch_local
from stp.runtime.mesh import Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.runtime.store import seal
from stp.runtime.watch import BeatMonitor, Heartbeat
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule
from stp.train.run.config import TrainJob

GLOO_CLOSED = ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
               "closed by peer [127.0.0.1]:60041. This is typically caused by a remote worker "
               "crashing. Check the logs of the remote worker before reporting an error. "
               "GLHF! \U0001f3d6")
GLOO_TIMEOUT = ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 3000ms for recv operation to complete")


def test_backend_errors_are_told_apart_and_trimmed_to_ascii() -> None:
    closed, timeout = RuntimeError(GLOO_CLOSED), RuntimeError(GLOO_TIMEOUT)
    assert failure_kind(closed) == "peer_lost" and failure_kind(timeout) == "timeout"
    assert failure_kind(RuntimeError("shape mismatch")) == "other"
    assert first_line(closed) == "Connection closed by peer [127.0.0.1]:60041"
    assert first_line(timeout) == "Timed out waiting 3000ms for recv operation to complete"
    assert exit_status(PeerLost("x")) == exit_status(CommTimeout("x")) == EXIT_PEER
    assert exit_status(timeout) == EXIT_PEER
    assert exit_status(RankError("x")) == exit_status(ValueError("x")) == EXIT_FAILED


# What each backend says when the rank at the other end went away or never answered
# (gloo's tcp transport, NCCL's watchdog, the store), and errors of this rank's own.
LOST = [GLOO_CLOSED, "[pair.cc:575] Connection reset by peer", "Broken pipe",
        "recv: Connection refused", "socket closed", "NCCL communicator was aborted on rank 1",
        "Gloo pair closure: the other side is gone"]
STALLED = [GLOO_TIMEOUT, "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
           "OpType=ALLREDUCE) ran for 300000 milliseconds before timing out."]
OWN = ["shape mismatch", "CUDA out of memory. Tried to allocate 2.00 GiB"]


def _wrapped(err: BaseException, **kw) -> RankError:
    return wrap(err, where="rank 2 (pp 0, tp 0, dp 1)", action="DP gradient all-reduce",
                peers="a rank in the DP group (global ranks [0, 2])", **kw)


def test_wrap_tells_a_lost_peer_from_a_timeout_from_a_rank_error() -> None:
    lost = [RuntimeError(text) for text in LOST] + [dist.DistNetworkError("no details")]
    for err in lost:
        got = _wrapped(err)
        assert type(got) is PeerLost, (err, got)
        assert str(got).startswith("rank 2 (pp 0, tp 0, dp 1) in DP gradient all-reduce: "
                                   "a rank in the DP group (global ranks [0, 2]) closed the "
                                   "connection: that process ended ("), got
    for text in STALLED:
        got = _wrapped(RuntimeError(text))
        assert type(got) is CommTimeout, (text, got)
        assert ": timed out waiting for a rank in the DP group (global ranks [0, 2]) (" in str(
            got), got
    for text in OWN:
        got = _wrapped(RuntimeError(text))
        assert type(got) is RankError, (text, got)
        assert str(got) == f"rank 2 (pp 0, tp 0, dp 1) in DP gradient all-reduce: {text}"
    assert str(_wrapped(RuntimeError(GLOO_CLOSED))).endswith(
        "(Connection closed by peer [127.0.0.1]:60041)")  # trimmed to the backend's first line


def test_wrap_says_how_long_and_for_what_when_told() -> None:
    lost = _wrapped(RuntimeError(GLOO_CLOSED), awaiting="data", waited=2.04, timeout=30)
    assert "closed the connection after 2.0 s of waiting for data: that process ended" in str(
        lost)
    stalled = _wrapped(RuntimeError(GLOO_TIMEOUT), awaiting="data", waited=30.1, timeout=30)
    assert "waited more than 30 s for data from a rank in the DP group" in str(stalled)
    assert exit_status(lost) == exit_status(stalled) == EXIT_PEER
    assert exit_status(_wrapped(RuntimeError(OWN[0]), waited=1.0)) == EXIT_FAILED


def test_diagnosis_names_the_cause_not_its_consequences() -> None:
    killed = {0: WorkerExit(0, EXIT_PEER, 1.0), 1: WorkerExit(1, -9, 1.0),
              2: WorkerExit(2, -15, 1.2, stopped=True)}
    assert diagnose(killed, {}) == (1, "rank 1 was killed by SIGKILL")
    failed = {0: WorkerExit(0, EXIT_PEER, 0.5), 1: WorkerExit(1, 1, 0.7)}
    assert diagnose(failed, {}) == (1, "rank 1 exited with status 1")
    same_poll = {0: WorkerExit(0, EXIT_FAILED, 2.0), 1: WorkerExit(1, -9, 2.0)}
    assert diagnose(same_poll, {})[0] == 1  # the killed one, not its peer's error
    frozen = {0: WorkerExit(0, EXIT_PEER, 10.0), 2: WorkerExit(2, -9, 11.0, stopped=True)}
    rank, line = diagnose(frozen, {2: 10.4}, describe=lambda r: f"rank {r} (pp {r})")
    assert rank == 2 and line.startswith("rank 2 (pp 2) stopped responding: no heartbeat for "
                                         "10.4 s")
    assert WorkerExit(3, 143, 1.0).how() == "exited on SIGTERM (status 143)"
    assert WorkerExit(3, -9, 1.0).status == 137


def _return_die_or_wait(marker: Path) -> int:
    rank = int(os.environ["RANK"])
    if rank == 0:
        marker.touch()
    if rank == 1:  # dies once rank 0 has returned (and then exited at once)
        while not marker.exists():
            time.sleep(0.05)
        time.sleep(2.0)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        time.sleep(600)  # stopped by the launcher, else the test would wait 10 minutes
    return 10 * rank + 7


def test_local_launch_returns_values_and_names_a_killed_rank(tmp_path) -> None:
    start = time.monotonic()
    result = launch_local(_return_die_or_wait, (tmp_path / "returned",), 3)
    assert time.monotonic() - start < 300  # rank 2 was stopped, not waited for (600 s)
    assert result.returns == {0: 7} and result.exits[0].returncode == 0
    assert result.exitcode == 137 and result.culprit == 1 and result.failed_ranks == [1]
    assert result.cause == "rank 1 was killed by SIGKILL"
    assert result.exits[2].stopped
    assert result.exits[2].how() == "was stopped after another rank failed"


def _peer_leaves(rank: int, world: int) -> None:
    mesh = Mesh.from_world(ParallelDims(pp=2), timeout=30)
    if rank == 0:
        time.sleep(0.5)
        os._exit(0)  # gone without a word
    comm = next(c for c in lower(make_schedule("1f1b", 2, 2)).actions[1] if str(c) == "1RECV_F0")
    p2p = P2P(mesh.pp_group, mesh.ranks["pp"], 2, timeout=30, where=mesh.describe())
    (t,) = p2p.post([(comm, torch.empty(2))])
    p2p.wait(t, needed_by="1F0")


def test_a_peer_that_leaves_is_not_reported_as_a_timeout() -> None:
    with pytest.raises(DistFailure) as info:
        run_dist(_peer_leaves, 2, timeout=60)
    err = info.value.errors[1]
    assert err.startswith("PeerLost: rank 1 (pp 1, tp 0, dp 0) in 1RECV_F0 before 1F0: "
                          "pipeline rank 0 (global rank 0, stage 0) closed the connection "
                          "after "), err
    waited = float(err.split("closed the connection after ")[1].split(" s")[0])
    assert waited < 10 and "waited more than" not in err  # not the 30 s timeout


def test_heartbeats_show_who_stopped() -> None:
    store = dist.HashStore()
    beating = Heartbeat(store, 0, 3)
    # rank 2 beat once (signed, as ranks beat), then froze; rank 1 never started
    store.set("stp/beat/2", seal("stp/beat/2", "1"))
    assert beating.silent_ranks(window=0.6) == [1, 2]
    monitor = BeatMonitor(store, 3)
    monitor.poll(now=0.0)
    time.sleep(0.6)
    monitor.poll(now=3.0)
    assert monitor.silences(now=3.0, ranks=[0, 1, 2]) == {2: 3.0}  # rank 0 beats on
    beating.stop()


def test_interrupt_line_says_the_step_and_the_last_checkpoint() -> None:
    tracker = StepTracker(lambda report: None)
    assert tracker.interrupted() == "stp: interrupted before the first step"

    class Report:
        step, checkpoint = 6, None

    tracker(Report())
    assert tracker.interrupted() == "stp: interrupted at step 7; no checkpoint yet"
    Report.step, Report.checkpoint = 9, "runs/x/step-00000010"
    tracker(Report())
    assert tracker.interrupted() == ("stp: interrupted at step 10; last checkpoint: "
                                     "runs/x/step-00000010")


WATCHED = """
import sys, time
from stp.runtime.watch import exit_on_signals
exit_on_signals(lambda sig: print("stopping on", sig, flush=True))
print("ready", flush=True)
time.sleep(60)
"""


def test_signal_watcher_exits_at_once_without_a_traceback() -> None:
    proc = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    # "At once": well before the watched sleep's 60 s, with room for a loaded machine.
    assert proc.returncode == 143 and time.monotonic() - start < 20
    assert out == f"stopping on {int(signal.SIGTERM)}\n" and err == ""


def test_settings_nodes_must_share() -> None:
    base = shared_settings(TrainJob())
    assert base["--pp"] == "2" and base["--braid"] == "on" and base["--trace"] == "off"
    assert "--out" not in base  # rank 0 chooses it
    other = shared_settings(TrainJob(pp=4, seed=3))
    assert first_difference(base, other) == ("--pp", "2", "4")
    assert first_difference(base, dict(base)) is None
    assert first_difference({"--a": "1"}, {"--a": "1", "--b": "2"}) == ("--b", "(unset)", "2")
