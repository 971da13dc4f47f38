"""Faults in `stp train`: signals, a killed worker, a frozen worker, nodes that disagree.

Each test starts the real command in its own session (a process group, as a
terminal would), waits for the first step, does what a user or the machine
does (Ctrl-C, `kill`, SIGSTOP), and checks what the command does about it:
one true line, the exit status, the time it takes, and no process left.
Times are measured from the fault, not from the start (starting 2 workers
takes 5-30 s on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

TINY = ["--schedule", "1f1b", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len",
        "16", "--microbatch-size", "1", "-m", "2", "--steps", "100000"]
START_S = 120.0  # starting the workers, on a loaded machine


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


class _Train:
    """`stp train ARGS` in its own session, its stderr read line by line."""

    def __init__(self, *argv: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "stp.cli.main", "train", *TINY, "--out", str(tmp), *argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pids: list[int] = []

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_step(self) -> dict[int, int]:
        """Block until the first step is printed; returns {rank: worker pid}."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            line = self.lines.get(timeout=deadline - time.monotonic())
            assert line is not None, "stp train ended before its first step:\n" + "".join(
                self.stderr)
            self.stderr.append(line)
            if line.startswith("step "):
                self.pids = _descendants(self.proc.pid)
                return {r: p for p in self.pids if (r := _rank_of(p)) is not None}
        raise AssertionError("no step within the start-up time")

    def finish(self, within: float) -> tuple[int, list[str], float]:
        """(exit status, stderr lines that are not progress or the start-up line, seconds
        it took)."""
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=within)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        elapsed = time.monotonic() - start
        while (line := self.lines.get(timeout=10)) is not None:
            self.stderr.append(line)
        said = [x.rstrip("\n") for x in self.stderr]
        return code, [x for x in said if not x.startswith(("step ", "start-up: "))], elapsed

    def leftovers(self) -> list[int]:
        time.sleep(0.2)
        return [p for p in self.pids if _alive(p)]


@pytest.mark.parametrize("target,sig,status", [
    ("group", signal.SIGINT, 130),  # Ctrl-C in a terminal
    ("launcher", signal.SIGINT, 130),  # kill -INT <stp>
    ("launcher", signal.SIGTERM, 143),  # kill <stp>, a job scheduler
])
def test_interrupt_stops_every_rank_with_one_line(tmp_path, target, sig, status) -> None:
    run = _Train("--pp", "2", tmp=tmp_path)
    workers = run.wait_for_step()
    assert sorted(workers) == [0, 1]
    if target == "group":
        os.killpg(run.proc.pid, sig)
    else:
        os.kill(run.proc.pid, sig)
    code, lines, elapsed = run.finish(within=90)
    assert code == status, lines
    assert len(lines) == 1 and lines[0].startswith("stp: interrupted at step "), lines
    assert "no checkpoint yet" in lines[0] or "last checkpoint: " in lines[0]
    # promptly, not after the 120 s collective timeout
    assert elapsed < 100, elapsed  # well under the 120 s timeout, whatever the load
    assert run.leftovers() == []


def test_killed_worker_is_named_with_its_signal(tmp_path) -> None:
    run = _Train("--pp", "2", tmp=tmp_path)
    workers = run.wait_for_step()
    os.kill(workers[1], signal.SIGKILL)
    code, lines, elapsed = run.finish(within=90)
    assert code == 1
    assert lines[-1] == ("stp: error: training stopped: rank 1 (pp 1, tp 0, dp 0) was killed "
                         "by SIGKILL; the other ranks were stopped"), lines
    survivor = [x for x in lines if x.startswith("stp: error: rank 0 ")]
    assert len(survivor) == 1, lines
    # a closed connection, said as such: in a receive from rank 1 with the time actually
    # waited (not "120 s"), or, when the kill lands while rank 0 is in the step's
    # closing collective (the activation peaks' gather), in that collective
    assert ("pipeline rank 1 (global rank 1, stage 1) closed the connection after"
            in survivor[0] or "a rank in the world closed the connection: that process ended"
            in survivor[0]), survivor
    assert "waited more than" not in survivor[0] and "Traceback" not in "".join(lines)
    # promptly, not after the 120 s collective timeout
    assert elapsed < 100, elapsed  # well under the 120 s timeout, whatever the load
    assert run.leftovers() == []


def test_frozen_worker_is_named_and_the_group_exits(tmp_path) -> None:
    run = _Train("--pp", "2", "--timeout", "3", tmp=tmp_path)
    workers = run.wait_for_step()
    os.kill(workers[1], signal.SIGSTOP)
    code, lines, elapsed = run.finish(within=60)
    assert code == 1
    assert lines[-1].startswith("stp: error: training stopped: rank 1 (pp 1, tp 0, dp 0) "
                                "stopped responding: no heartbeat for "), lines
    survivor = [x for x in lines if x.startswith("stp: error: rank 0 ")]
    assert len(survivor) == 1, lines
    # It timed out in a receive from rank 1 or in a collective with it (which one
    # depends on where the pipeline stood), and names rank 1 as the silent one.
    assert ("waited more than 3 s for data from pipeline rank 1" in survivor[0]
            or "Timed out waiting 3000ms" in survivor[0]), survivor
    assert survivor[0].endswith("; global rank 1 sent no heartbeat in the last 2 s: "
                                "frozen or stopped"), survivor
    assert elapsed < 45, elapsed  # the 3 s timeout, the heartbeat check, the stop; not a hang
    assert run.leftovers() == []


def test_nodes_without_a_shared_secret_are_refused(tmp_path) -> None:
    """Two "nodes" under torchrun's store and no STP_JOB_TOKEN: one line, exit 2, before
    any rank reads the store."""
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "STP_JOB_TOKEN": ""}
    code, lines, _ = _Train("--pp", "2", tmp=tmp_path, env=env).finish(within=START_S)
    assert code == 2
    assert lines == ["stp: error: a run over several nodes needs STP_JOB_TOKEN: export the "
                     "same random secret on every node (e.g. STP_JOB_TOKEN=$(openssl rand "
                     "-hex 16)) so that stp trusts only its own ranks' heartbeats and settings"]


def test_nodes_started_with_different_settings_are_told_which(tmp_path) -> None:
    """Two "nodes" of one rank each under a torchrun-like store: --lr differs."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "STP_JOB_TOKEN": "test-secret"}
    lr = {0: "0.003", 1: "0.01"}
    runs = [_Train("--pp", "2", "--lr", lr[r], tmp=tmp_path, env={**env, "RANK": str(r)})
            for r in range(2)]
    results = [run.finish(within=START_S) for run in runs]
    assert [code for code, _, _ in results] == [2, 2]
    expected = ("stp: error: ranks were started with different settings: --lr is 0.003 on "
                "rank 0 but 0.01 on rank 1; start every node with the same settings")
    assert results[0][1] == [expected]  # rank 0's node
    assert results[1][1] == [expected]  # the other node hears it too
    assert not list(tmp_path.iterdir()), "nothing is created when the nodes disagree"
