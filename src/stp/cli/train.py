"""`stp train`: train a byte-level decoder on TP x PP x DP with any schedule.

    stp train                                 # 2 pipeline ranks, schedule stp
    stp train --schedule 1f1b --pp 2 --dp 2   # starts 4 local workers itself
    stp train --offload stp --json           # chunk-0 activations to the host; per-rank
                                              # peak resident activation bytes per step
    torchrun --nproc-per-node 4 -m stp.cli.main train --pp 2 --tp 2
    stp train --tp 2 --trace run.json         # the last step's measured trace (Perfetto)
    stp train --tp 2 --emulate-compute f=24,b=24,w=16 --braid off   # timed waits, real comm

Without torchrun the command starts pp x tp x dp local worker processes
itself (stp.runtime.launch); under torchrun each process is one rank, and
the nodes' settings are compared before the ranks meet. Bad input is
refused before any worker starts (under torchrun: by every rank, reported
once by rank 0), with exit status 2. A rank that fails or waits past
--timeout prints one line naming itself, the action and the peer, every
rank exits non-zero, and the last line names the rank the failure started
at (a killed, failed or frozen one). Ctrl-C (SIGINT) or SIGTERM stops every
rank at once: `stp: interrupted at step N; last checkpoint: ...`, exit 130
(SIGTERM: 143). See stp.cli.train_supervise.

Output: a progress bar on stderr (loss, tokens/s, step time; an MoE's aux
loss and expert load), with --compile a word while the first step compiles,
a summary (its `ran:` line states the configuration as it ran: mesh,
schedule, batch, dtype, sp, recompute, sharded optimizer, overlaps, offload,
the model) and a sharded checkpoint at the end (--save-full / --save-hf: the
whole model as one safetensors file / a Hugging Face directory, written
stage by stage); with --json, one JSON object per step on stdout and nothing
else there. After the first step, one start-up line on stderr: the time to
first step and where it went (stp.train.run.startup); --json's first row records
it as "startup". torch is imported only when the command runs, after the
checks the flags alone allow (stp.train.run.precheck).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import TYPE_CHECKING

from stp.cli.common import EXIT_USAGE
from stp.cli.flags import add_flags, from_args
from stp.cli.train_output import CompileProgress, Progress, print_summary
from stp.cli.train_supervise import (
    StepTracker,
    interrupt_printer,
    launch_failure_line,
    rank_failure_line,
    rank_namer,
    say,
    shared_settings,
)
from stp.train.run.config import TrainJob

if TYPE_CHECKING:  # torch is imported when the command runs, not for --help
    from stp.train.run.resolve import Run

EXIT_AGREED = 4
"""A worker's status when every rank raised the same verdict (an exception class with
`agreed = True`: a damaged checkpoint, a storage fault, non-finite weights) and rank 0
reported it: the launcher then prints nothing more and the run exits 1."""

__all__ = ["register", "run_train"]



def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a small byte-level language model on a TP x PP x DP mesh",
        description="Train a byte-level decoder on the Python standard library's sources "
        "(or --data) with any schedule. Starts the local workers itself unless run under "
        "torchrun.",
    )
    add_flags(p, TrainJob)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per step on stdout and nothing else there")
    p.set_defaults(func=run_train)


def _train_here(resolved: Run, as_json: bool) -> int:
    """Train as one rank of an initialised (or about to be) world; returns the exit
    status (stp.cli.train_supervise: what a failure or an interrupt prints)."""
    from stp.runtime.errors import exit_status
    from stp.runtime.launch import init_distributed
    from stp.runtime.watch import Heartbeat, exit_on_signals
    from stp.train.run.loop import run

    job = resolved.job
    progress = Progress(job.steps, as_json)
    tracker = StepTracker(progress)
    if os.environ.get("RANK", "0") == "0":
        exit_on_signals(interrupt_printer(tracker, bar=not as_json))
    else:
        exit_on_signals()
    heartbeat = None
    try:
        init_distributed(timeout=job.timeout)
        heartbeat = Heartbeat.from_env(timeout=job.timeout)
        summary = run(resolved, tracker, on_compile=CompileProgress(sys.stderr.isatty()))
    except (ValueError, RuntimeError) as e:  # RankError, a backend's error: one line
        if getattr(type(e), "agreed", False) and job.world_size > 1:
            # every rank raised the same verdict: rank 0 says it once, the launcher
            # adds nothing (EXIT_AGREED)
            if os.environ.get("RANK", "0") == "0":
                say(rank_failure_line(e, heartbeat))
            return EXIT_AGREED
        say(rank_failure_line(e, heartbeat))
        return exit_status(e)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    if summary is not None:
        print_summary(summary, as_json, resolved.config,
                 (progress.first_figures, progress.last_figures))
    return 0


def _worker(resolved: Run, as_json: bool) -> None:
    """Entry point of a locally launched worker (module level: started by name), given
    the run resolved once by the launching process (stp.train.run.resolve.Run)."""
    code = _train_here(resolved, as_json)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # Leave at once: tearing down process groups whose peers are gone can block.
        os._exit(code)


def _check_job_secret() -> None:
    """A multi-node run trusts heartbeats and settings from torch's agent store, which
    listens on the network: only with a secret every node shares (stp.runtime.store)."""
    from stp.runtime.store import TOKEN_ENV

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)) and not os.environ.get(TOKEN_ENV):
        raise ValueError(f"a run over several nodes needs {TOKEN_ENV}: export the same random "
                         f"secret on every node (e.g. {TOKEN_ENV}=$(openssl rand -hex 16)) so "
                         "that stp trusts only its own ranks' heartbeats and settings")


def _under_torchrun(job: TrainJob, as_json: bool) -> int:
    """One rank started by torchrun: the nodes' settings compared, every rank
    checks, rank 0 alone reports, all exit 2 at once. (The default run directory is
    made by rank 0 once the ranks meet: stp.train.run.loop.)"""
    from stp.runtime.agree import SettingsDiffer, agree
    from stp.runtime.launch import STARTUP_S
    from stp.train.run.job import check
    from stp.train.run.schedules import with_schedule_file

    try:
        _check_job_secret()
        # The nodes may start seconds apart: wait as long as a start may take.
        agree(shared_settings(job), timeout=max(job.timeout, STARTUP_S))
        job = with_schedule_file(job)
        resolved = check(job, world_size=int(os.environ["WORLD_SIZE"]))
        if not _announce(resolved, quiet=os.environ.get("RANK") != "0"):
            return 0
    except ValueError as e:
        # Once: by rank 0; a disagreement also on the other nodes (their first rank).
        if os.environ.get("RANK") == "0" or (
                isinstance(e, SettingsDiffer) and os.environ.get("LOCAL_RANK") == "0"):
            say(f"stp: error: {e}")
        return EXIT_USAGE
    code = _train_here(resolved, as_json)
    if code:
        sys.stderr.flush()
        os._exit(code)
    return 0


def _announce(resolved: Run, *, quiet: bool = False) -> bool:
    """Say what the run reads and where it resumes (stderr: stdout keeps --json's lines);
    False when a resumed run has nothing left to train."""
    job = resolved.job
    lines = []
    if resolved.resumed is not None:
        if resolved.resumed_step >= job.steps:
            if not quiet:
                say(f"stp: nothing to do: {resolved.resumed} has trained "
                    f"{resolved.resumed_step} steps and --steps is {job.steps}; give --steps "
                    f"above {resolved.resumed_step} to train on")
            return False
        lines.append(f"resuming from step {resolved.resumed_step} ({resolved.resumed})")
    if job.data is not None:  # format, documents, tokens, skipped (stp.train.data.load)
        from stp.train.data.load import check_data

        lines.append(check_data(job, resolved).line())
    if not quiet:
        for line in lines:
            say(line)
    return True


def _torchrun_env() -> bool:
    """stp.runtime.launch.in_torchrun without importing torch: torchrun's variables set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_train(args: argparse.Namespace) -> int:
    # Before torch loads OpenMP (here and in spawned workers): idle intra-op
    # threads sleep instead of spinning. Spinning threads on shared cores
    # (local workers, other jobs) measured 10-100x slower steps on 2 cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from stp.train.run.precheck import precheck

    job = from_args(TrainJob, args)
    if job.plan is not None:
        from stp.train.run.plan_file import with_plan

        notes: list[str] = []
        job = with_plan(job, notes)
        if os.environ.get("RANK", "0") == "0":
            for note in notes:
                say(f"stp: note: {note}")
    if not _torchrun_env():
        # What the flags alone show is refused before torch loads (5-20 s on a loaded
        # machine); under torchrun every rank checks and rank 0 alone reports
        # (_under_torchrun), so the full checks say it there.
        precheck(job)
    from stp.runtime.launch import in_torchrun, launch_local
    from stp.train.run.job import check
    from stp.train.run.outlock import existing_out, hold_out
    from stp.train.run.schedules import with_schedule_file
    from stp.train.run.startup import mark_launch

    entered = time.time()  # time to first step's `imports` (torch, stp) end here
    if in_torchrun():
        mark_launch(entered)  # each rank's own process; its checks count as workers
        return _under_torchrun(job, args.json)
    # One run per --out until this process ends (stp.train.run.outlock). An existing one
    # (--out, or the run --resume continues) is locked before the checks: a run in
    # progress is the answer, not its half-written files; a new one after them, so
    # that refused input leaves nothing behind.
    early = existing_out(job)
    if early is not None:
        hold_out(early)
    job = with_schedule_file(job)  # -m of a schedule file, before the batch size is fixed
    resolved = check(job)
    job = resolved.job
    if job.out is None:  # fixed once, after the checks: the default is a new directory
        job = dataclasses.replace(job, out=str(job.out_dir()))
        resolved = dataclasses.replace(resolved, job=job)
    hold_out(job.out)
    if not _announce(resolved):
        return 0
    mark_launch(entered)
    if job.world_size == 1:
        return _train_here(resolved, args.json)
    result = launch_local(_worker, (resolved, args.json), job.world_size,
                          describe=rank_namer(job))
    if result.interrupted is not None:
        if result.exits[0].returncode < 0:  # rank 0 ended before it could say where it was
            say("stp: interrupted")
        return result.exitcode
    if result.exitcode:
        if result.exits.get(0) is not None and result.exits[0].returncode == EXIT_AGREED:
            return 1  # rank 0 said why, for every rank (_train_here)
        print(launch_failure_line(result), file=sys.stderr, flush=True)
        return 1
    return 0
