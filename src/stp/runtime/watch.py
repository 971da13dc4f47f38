"""Keeping a worker answerable: a prompt, quiet exit on SIGINT/SIGTERM, and a heartbeat.

Signals. A rank spends most of its time blocked in a backend call (a
receive, an all-reduce) that runs no Python, so a Python signal handler
would run only when that call returns, up to the timeout later, and then
raise KeyboardInterrupt with a traceback. `exit_on_signals` lets the C-level
handler write the signal's number to a pipe (`signal.set_wakeup_fd`); a
watcher thread reading the pipe runs `on_signal` (rank 0 says where training
stood) and ends the process at once with status 128 + the signal number,
the shell's convention. Under `stp.runtime.launch.launch_local` the watcher
also ends the worker when the launcher is gone, so no worker outlives it.

Heartbeat. A frozen process (SIGSTOP, a hung driver, a swapped-out node)
closes no connection: its peers see only a timeout, and cannot tell which
rank is at fault. Every rank writes its beat count, signed with the job's
secret (stp.runtime.store.seal), to `stp/beat/<rank>` in the job's store
every `BEAT_S` seconds from a daemon thread; the thread stops only
when the whole process stops, so a counter that stops moving names a frozen
rank. A rank that timed out asks `Heartbeat.silent_ranks`; the local
launcher follows the counters all along (`BeatMonitor`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from stp.runtime.store import seal, shared_store, unseal

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "BEAT_S", "SILENCE_S", "LAUNCHER_PID_ENV", "beat_key", "exit_on_signals", "Heartbeat",
    "BeatMonitor",
]

BEAT_S = 0.25
"""Seconds between two beats of one rank."""
SILENCE_S = 2.0
"""Seconds without a beat after which a rank counts as frozen (8 missed beats: a
loaded machine delays a thread by far less)."""
LAUNCHER_PID_ENV = "STP_LAUNCHER_PID"
"""Set by the local launcher: the worker exits when this process is gone."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PARENT_POLL_S = 0.5


def beat_key(rank: int) -> str:
    return f"stp/beat/{rank}"


def read_beat(store: dist.Store, rank: int, token: str | None = None) -> int:
    """Rank `rank`'s beat count, 0 before its first beat or when the value was not
    signed with the job's secret (written by someone else: stp.runtime.store)."""
    key = beat_key(rank)
    if not store.check([key]):
        return 0
    value = unseal(key, store.get(key), token)
    return int(value) if value is not None and value.isdigit() else 0


class _SignalWatcher:
    """The pipe, the thread and the callback behind `exit_on_signals` (one per process:
    signal dispositions belong to the process)."""

    def __init__(self) -> None:
        self.on_signal: Callable[[int], None] | None = None
        # Watched only by the launcher's own children (the variable is inherited further).
        launched = os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid())
        self.launcher = os.getppid() if launched else None
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for sig in STOP_SIGNALS:
            # A Python-level handler must exist for the C handler to write to the
            # pipe; it does nothing itself (the watcher acts).
            signal.signal(sig, _noop)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="stp-signal-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            ready, _, _ = select.select([self.read_fd], [], [], _PARENT_POLL_S)
            if ready:
                for signum in os.read(self.read_fd, 64):
                    if signum in STOP_SIGNALS:
                        self._exit(signum)
            elif self.launcher is not None and os.getppid() != self.launcher:
                os._exit(128 + signal.SIGHUP)  # the launcher is gone: nobody reads our output

    def _exit(self, signum: int) -> None:
        callback = self.on_signal
        if callback is not None:
            with contextlib.suppress(Exception):  # exiting anyway
                callback(signum)
        os._exit(128 + signum)


def _noop(signum: int, frame: object) -> None:
    """The Python-level handler: the watcher thread does the work."""


_watcher: _SignalWatcher | None = None


def exit_on_signals(on_signal: Callable[[int], None] | None = None) -> bool:
    """From now on SIGINT and SIGTERM end this process within a moment, even while
    it is blocked in a backend call: `on_signal(signum)` runs first (keep it short:
    print one line), then the process exits with 128 + signum, without a traceback
    and without running cleanup that could block on peers.

    Call from the main thread (False elsewhere: nothing installed). Calling again
    replaces `on_signal`."""
    global _watcher
    if threading.current_thread() is not threading.main_thread():
        return False
    if _watcher is None:
        _watcher = _SignalWatcher()
    _watcher.on_signal = on_signal
    return True


class Heartbeat:
    """Beats for this rank into `store` every BEAT_S seconds (see the module doc)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._lock = threading.Lock()  # one store client, two threads
        self._stop = threading.Event()
        self._beats = 0
        threading.Thread(target=self._run, name="stp-heartbeat", daemon=True).start()

    @classmethod
    def from_env(cls, *, timeout: float) -> Heartbeat | None:
        """A heartbeat into the launcher's store (the local launcher's or torchrun's
        agent store), or None when there is none (a single process, or a launcher
        whose store the workers do not share)."""
        shared = shared_store(timeout)
        if shared is None:
            return None
        return cls(shared.store, shared.rank, shared.world_size)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beats += 1
                key = beat_key(self.rank)
                with self._lock:  # signed: a beat nobody else can fake
                    self.store.set(key, seal(key, str(self._beats)))
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return

    def stop(self) -> None:
        self._stop.set()

    def counts(self) -> list[int]:
        with self._lock:
            return [read_beat(self.store, r) for r in range(self.world_size)]

    def silent_ranks(self, window: float = SILENCE_S) -> list[int]:
        """The other ranks that did not beat during the next `window` seconds."""
        try:
            before = self.counts()
            time.sleep(window)
            after = self.counts()
        except Exception:  # noqa: BLE001 - no store, no verdict
            return []
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]


class BeatMonitor:
    """The launcher's view of every rank's heartbeat: how long each has been silent.

    Only ranks that have beaten at least once count (a rank still importing
    torch has not started its heartbeat yet)."""

    def __init__(self, store: dist.Store, world_size: int, token: str | None = None) -> None:
        self.store, self.world_size, self.token = store, world_size, token
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it changed)
        self._polled = float("-inf")

    def poll(self, now: float) -> None:
        """Read the counters (at most every BEAT_S seconds)."""
        if now - self._polled < BEAT_S:
            return
        self._polled = now
        for r in range(self.world_size):
            count = read_beat(self.store, r, self.token)
            old = self._seen.get(r)
            if count and (old is None or old[0] != count):
                self._seen[r] = (count, now)

    def silences(self, now: float, ranks: list[int]) -> dict[int, float]:
        """Seconds since each of `ranks` last beat, for those silent over SILENCE_S."""
        out = {}
        for r in ranks:
            seen = self._seen.get(r)
            if seen is not None and now - seen[1] > SILENCE_S:
                out[r] = now - seen[1]
        return out
