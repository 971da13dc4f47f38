"""The worker side of `stp.runtime.launch.launch_local`: one rank's process.

The launcher starts each rank as `python -c COMMAND DIR` with the rank's
environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). Until `main` runs,
SIGINT and SIGTERM have their default action (the kernel ends the process
at once): importing this package loads torch, seconds in which no Python
handler could run (an extension module loads under the interpreter lock)
and after which Python's own would print a KeyboardInterrupt traceback.
`main` then hands them to stp.runtime.watch (rank 0 says
`stp: interrupted while starting` until the entry point says more), takes the
launcher's sys.path, working directory and __main__ module as
multiprocessing's spawn does, runs the entry point pickled in DIR and
writes its return value back to DIR (write, then rename: the launcher never
reads half a file), and leaves without the interpreter's teardown.
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing import spawn
from pathlib import Path

from stp.runtime.watch import exit_on_signals

__all__ = ["COMMAND", "STARTING", "PREPARATION", "CALL", "return_path", "main"]

STARTING = "stp: interrupted while starting\n"
"""What rank 0 says when interrupted before its entry point says something else."""
COMMAND = (
    "import signal\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "from stp.runtime.worker import main\n"
    "main()\n"
)
PREPARATION = "preparation.pkl"
"""multiprocessing.spawn's preparation data: sys.path, cwd, the __main__ module."""
CALL = "call.pkl"
"""(entry, args) to run."""


def return_path(directory: Path, rank: int) -> Path:
    return directory / f"return-{rank}.pkl"


def _starting(signum: int) -> None:
    os.write(2, STARTING.encode())


def main() -> None:
    exit_on_signals(_starting if os.environ.get("RANK") == "0" else None)
    directory = Path(sys.argv[1])
    with open(directory / PREPARATION, "rb") as f:
        spawn.prepare(pickle.load(f))
    with open(directory / CALL, "rb") as f:
        entry, args = pickle.load(f)  # after prepare: entry's module is importable now
    value = entry(*args)
    final = return_path(directory, int(os.environ["RANK"]))
    partial = final.with_suffix(".partial")
    with open(partial, "wb") as f:
        pickle.dump(value, f)
    os.replace(partial, final)
    sys.stdout.flush()
    sys.stderr.flush()
    # Done: skip the interpreter's teardown (a second or more with torch loaded,
    # and process groups whose peers are gone can block it).
    os._exit(0)
