"""Starting the ranks: under torchrun, or locally by stp's own launcher.

* Under `torchrun` (one node or many) every process already has RANK,
  WORLD_SIZE, MASTER_ADDR, ... in its environment; `init_distributed` reads
  them (the env:// method).
* Without torchrun, `launch_local` starts one process per rank itself
  (stp.runtime.worker), so one command trains on a laptop. It hosts the
  job's store (a TCPStore on a free port it holds, the way torchrun's agent
  does: no port race; listening on 127.0.0.1 only, its heartbeats signed with
  a per-job secret: stp.runtime.store), watches every worker's exit and heartbeat
  (stp.runtime.watch), and when one fails, freezes or the launcher is
  interrupted, stops the rest and returns what happened: each rank's exit
  status or signal, and which rank failed first and why. (torch's
  elastic_launch, used before, reported a killed rank as "exit status 1",
  blamed whichever rank exited first, and printed tracebacks on Ctrl-C.)
* Ranks that start seconds apart meet first in the launcher's store
  (`wait_for_every_rank`, up to STARTUP_S), so a short --timeout bounds
  waits between running ranks, not the start.
* A world of one process needs no launcher: `init_distributed` makes a
  single-rank group in memory.

What a rank does to join (the device, the process group, the meeting) is
stp.runtime.join, re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import spawn
from pathlib import Path

import torch.distributed as dist

from stp.runtime import worker
from stp.runtime.errors import EXIT_PEER
from stp.runtime.join import (  # re-exported: the public names a rank's code calls
    STARTUP_S,
    in_torchrun,
    init_distributed,
    pick_device,
    wait_for_every_rank,
)
from stp.runtime.store import TOKEN_ENV, loopback_store, new_token
from stp.runtime.watch import LAUNCHER_PID_ENV, STOP_SIGNALS, BeatMonitor

__all__ = [
    "in_torchrun", "pick_device", "init_distributed", "WorkerExit", "LaunchResult",
    "launch_local", "wait_for_every_rank", "diagnose", "GRACE_S", "STARTUP_S",
]

GRACE_S = 3.0
"""Seconds stopped workers get to exit before SIGKILL."""
PEER_WINDOW_S = 1.5
"""Seconds the other ranks get to fail by themselves after the first failure."""
QUIET_STOP = signal.SIGUSR1
"""Ends a worker the launcher stops after another rank failed: its default action
ends the process without a word (SIGINT/SIGTERM would make rank 0 report an
interrupt that nobody asked for)."""
@dataclass(frozen=True)
class WorkerExit:
    """How one local worker ended."""

    rank: int
    returncode: int
    """The process's status; negative: killed by that signal (subprocess's convention)."""
    after_s: float
    """Seconds after the launch."""
    stopped: bool = False
    """The launcher had told it to stop (another rank failed, or an interrupt)."""

    @property
    def status(self) -> int:
        """The shell's exit status: 128 + the signal for a killed process."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def how(self) -> str:
        """`was killed by SIGKILL`, `exited on SIGTERM (status 143)`, `exited with status 1`,
        `was stopped after another rank failed`."""
        if self.stopped and self.returncode == -QUIET_STOP:
            return "was stopped after another rank failed"
        if self.returncode < 0:
            return f"was killed by {_signal_name(-self.returncode)}"
        if self.returncode > 128 and _signal_name(self.returncode - 128) != "":
            return f"exited on {_signal_name(self.returncode - 128)} (status {self.returncode})"
        return f"exited with status {self.returncode}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return ""


@dataclass
class LaunchResult:
    """What the local workers returned, or how they failed."""

    returns: dict[int, object]
    """Return value of each local rank that finished (all of them on success)."""
    exitcode: int
    """0 on success; else the failed rank's exit status (128 + signal for a killed
    rank), or 128 + the signal that interrupted the launcher."""
    failed_ranks: list[int]
    """Ranks that failed by themselves (not stopped by the launcher), in the order seen."""
    exits: dict[int, WorkerExit] = field(default_factory=dict)
    culprit: int | None = None
    """The rank the failure started at (None on success or an interrupt)."""
    cause: str = ""
    """One line: which rank failed first and why ("" on success or an interrupt)."""
    interrupted: int | None = None
    """SIGINT or SIGTERM when the launcher was interrupted, else None."""


def diagnose(
    exits: dict[int, WorkerExit], silences: dict[int, float],
    describe: Callable[[int], str] = lambda r: f"rank {r}",
) -> tuple[int | None, str]:
    """(culprit, one line) for a failed launch.

    A rank that failed by itself (an error, a signal) is a cause; a rank
    that exited EXIT_PEER only waited on a peer that timed out or went
    away. Without a cause among the exits, the rank whose heartbeat stopped
    longest ago (`silences`: seconds) is the one the others waited on.
    """
    # Seen in the same poll, a killed rank goes first: its peers' errors follow from it.
    by_time = sorted(exits.values(), key=lambda e: (e.after_s, e.returncode >= 0))
    own = [e for e in by_time if not e.stopped and e.returncode not in (0, EXIT_PEER)]
    if own:
        first = own[0]
        return first.rank, f"{describe(first.rank)} {first.how()}"
    if silences:
        r = max(silences, key=lambda k: silences[k])
        return r, (f"{describe(r)} stopped responding: no heartbeat for {silences[r]:.1f} s "
                   "(frozen or stopped); the ranks waiting on it timed out")
    waited = [e for e in by_time if e.returncode == EXIT_PEER]
    if waited:
        r = waited[0].rank
        return r, f"{describe(r)} timed out waiting on a peer; no rank was seen frozen or failed"
    return None, "the workers were stopped"


class _Workers:
    """The worker processes of one launch, their exits and their heartbeats."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]], store: dist.Store,
                 token: str) -> None:
        self.procs = procs
        self.start = time.monotonic()
        self.exits: dict[int, WorkerExit] = {}
        self.beats = BeatMonitor(store, len(procs), token)
        self._stopping = False
        self.silences_at_stop: dict[int, float] = {}
        """Seconds since each live, silent rank last beat, when the stop began."""

    def alive(self) -> list[int]:
        return [r for r in self.procs if r not in self.exits]

    def poll(self) -> list[WorkerExit]:
        """Record the workers that ended since the last poll; read the heartbeats."""
        now = time.monotonic()
        ended = []
        for r in self.alive():
            code = self.procs[r].poll()
            if code is not None:
                self.exits[r] = WorkerExit(r, code, now - self.start, self._stopping)
                ended.append(self.exits[r])
        with contextlib.suppress(Exception):  # heartbeats only sharpen the diagnosis
            self.beats.poll(now)
        return ended

    def stop(self, signum: int, grace: float) -> None:
        """Send `signum` (and SIGCONT, so a stopped process can act on it) to every
        live worker; SIGKILL those still there after `grace` seconds."""
        self._stopping = True
        self.silences_at_stop = self.beats.silences(time.monotonic(), self.alive())
        for r in self.alive():
            for sig in (signum, signal.SIGCONT):
                _signal(self.procs[r], sig)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
            self.poll()
        for r in self.alive():
            _signal(self.procs[r], signal.SIGKILL)
        for r in self.alive():
            self.procs[r].wait()
        self.poll()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


class _Interrupts:
    """SIGINT/SIGTERM to the launcher, recorded instead of raised (the main loop
    stops the workers); the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():  # else: signals stay as they are
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]  # signal.getsignal's None (not set from Python) is restored as is


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc settings for the workers, unless the caller's environment sets them: tensors
up to 256 MiB come from the heap instead of a fresh mmap each time, and the heap
keeps up to 1 GiB of freed memory instead of returning it, so a step's activations
reuse pages instead of faulting them in again (about 3k page faults per microbatch
and stage at hidden 256 with the split backward, 3-4% of the CPU time). Both are
needed: setting the trim threshold alone turns off glibc's dynamic mmap threshold,
leaving it at 128 KiB, so every large tensor becomes a fresh mmap (more faults)."""


def _start(directory: Path, nprocs: int, port: int,
           token: str) -> dict[int, subprocess.Popen[bytes]]:
    base = {**MALLOC_ENV, **os.environ, "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            # every rank is a client of the launcher's store, as under torchrun
            "TORCHELASTIC_USE_AGENT_STORE": "True", LAUNCHER_PID_ENV: str(os.getpid()),
            TOKEN_ENV: token}
    return {
        r: subprocess.Popen(
            [sys.executable, "-c", worker.COMMAND, str(directory)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.DEVNULL,
        )
        for r in range(nprocs)
    }


def _write_call(directory: Path, entry: Callable[..., object], args: tuple[object, ...]) -> None:
    prep = spawn.get_preparation_data("stp-worker")
    prep.pop("authkey", None)  # multiprocessing refuses to pickle it outside its own spawn
    for name, value in ((worker.PREPARATION, prep), (worker.CALL, (entry, args))):
        try:
            with open(directory / name, "wb") as f:
                pickle.dump(value, f)
        except OSError as e:  # a full /tmp or a file-size limit: one line, not a traceback
            raise OSError(e.errno, f"cannot write the workers' start file {directory / name}: "
                          f"{os.strerror(e.errno or 0).lower()}") from None


def _supervise(workers: _Workers, interrupts: _Interrupts, grace: float) -> None:
    """Wait until every worker ended; on an interrupt stop the rest at once. After the
    first failure the others get PEER_WINDOW_S to fail by themselves (a rank blocked
    on the dead one sees the closed connection within milliseconds and says so);
    then the rest are ended quietly (QUIET_STOP: they print nothing, the launcher
    reports)."""
    failed_at: float | None = None
    while workers.alive():
        ended = workers.poll()
        if interrupts.signum is not None:
            workers.stop(interrupts.signum, grace)
            continue
        if failed_at is None and any(e.returncode != 0 for e in ended):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= PEER_WINDOW_S:
            workers.stop(QUIET_STOP, grace)
        else:
            time.sleep(0.05)


def launch_local(
    entry: Callable[..., object], args: tuple[object, ...], nprocs: int, *,
    describe: Callable[[int], str] = lambda r: f"rank {r}", grace: float = GRACE_S,
) -> LaunchResult:
    """Run `entry(*args)` in `nprocs` local worker processes with RANK, WORLD_SIZE,
    MASTER_ADDR, ... set (`entry` must be importable by name: a module-level
    function) and return what happened; never raises for a worker's failure.

    `describe(rank)` names a rank in `LaunchResult.cause` (e.g. with its mesh
    coordinates). Called from the main thread, it handles SIGINT and SIGTERM:
    they stop every worker, and the result says so."""
    store = loopback_store(60.0)  # reachable from this machine only (stp.runtime.store)
    with tempfile.TemporaryDirectory(prefix="stp-launch-") as tmp, _Interrupts() as interrupts:
        directory = Path(tmp)
        _write_call(directory, entry, args)
        token = new_token()  # signs heartbeats: only this job's workers know it
        workers = _Workers(_start(directory, nprocs, store.port, token), store, token)
        try:
            _supervise(workers, interrupts, grace)
        finally:  # an exception here (a bug) must not leave workers behind
            if workers.alive():
                workers.stop(signal.SIGKILL, 0.0)
        returns = {}
        for r in range(nprocs):
            path = worker.return_path(directory, r)
            if workers.exits[r].returncode == 0 and path.exists():
                with open(path, "rb") as f:
                    returns[r] = pickle.load(f)
    return _result(workers, returns, interrupts.signum, describe)


def _result(
    workers: _Workers, returns: dict[int, object], interrupted: int | None,
    describe: Callable[[int], str],
) -> LaunchResult:
    exits = workers.exits
    failed = [e.rank for e in sorted(exits.values(), key=lambda e: e.after_s)
              if e.returncode != 0 and not e.stopped]
    if interrupted is not None:
        return LaunchResult(returns, 128 + interrupted, failed, exits, interrupted=interrupted)
    if not failed:
        return LaunchResult(returns, 0, [], exits)
    culprit, cause = diagnose(exits, workers.silences_at_stop, describe)
    status = exits[culprit].status if culprit is not None else 1
    return LaunchResult(returns, status or 1, failed, exits, culprit, cause)
