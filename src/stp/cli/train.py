"""`stp train`: train a byte-level decoder on TP x PP x DP with any schedule.

    stp train                                 # 2 pipeline ranks, schedule stp
    stp train --schedule 1f1b --pp 2 --dp 2   # starts 4 local workers itself
    stp train --offload stp --json           # chunk-0 activations to the host; per-rank
                                              # peak resident activation bytes per step
    torchrun --nproc-per-node 4 -m stp.cli.main train --pp 2 --tp 2
    stp train --tp 2 --trace run.json         # the last step's measured trace (Perfetto)
    stp train --tp 2 --emulate-compute f=24,b=24,w=16 --braid off   # timed waits, real comm

Without torchrun the command starts pp x tp x dp local worker processes
through PyTorch's launcher API (stp.runtime.launch); under torchrun each
process is one rank. Bad input is refused before any worker starts (under
torchrun: by every rank, reported once by rank 0), with exit status 2. A
rank that fails or waits past --timeout prints one line naming itself, the
action and the peer, and every rank exits non-zero.

Output: a progress bar on stderr (loss, tokens/s, step time), a summary and
a checkpoint at the end; with --json, one JSON object per step on stdout and
nothing else there. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stp.cli.common import positive_float, positive_int

__all__ = ["register", "run_train"]



def register(sub: argparse._SubParsersAction) -> None:
    from stp.runtime.job import DTYPES, TrainJob
    from stp.schedule.registry import names

    d = TrainJob()
    p = sub.add_parser(
        "train", help="train a small byte-level language model on a TP x PP x DP mesh",
        description="Train a byte-level decoder on the Python standard library's sources "
        "(or --data) with any schedule. Starts the local workers itself unless run under "
        "torchrun.",
    )
    p.add_argument("--schedule", default=d.schedule, choices=names(), metavar="NAME",
                   help=f"pipeline schedule (default {d.schedule}; see `stp schedules`)")
    p.add_argument("--pp", type=positive_int, default=d.pp, help=f"pipeline ranks (default {d.pp})")
    p.add_argument("--tp", type=positive_int, default=d.tp,
                   help=f"tensor-parallel ranks (default {d.tp})")
    p.add_argument("--dp", type=positive_int, default=d.dp,
                   help=f"data-parallel replicas (default {d.dp})")
    p.add_argument("--microbatches", "-m", type=positive_int, default=None,
                   help="microbatches per step (default 8, more if the schedule or 2 pp "
                   "needs it); the global batch is dp x m x microbatch size")
    p.add_argument("--microbatch-size", type=positive_int, default=d.microbatch_size,
                   help=f"sequences per microbatch (default {d.microbatch_size})")
    p.add_argument("--layers", type=positive_int, default=d.layers,
                   help=f"transformer layers (default {d.layers})")
    p.add_argument("--hidden", type=positive_int, default=d.hidden,
                   help=f"model width (default {d.hidden})")
    p.add_argument("--heads", type=positive_int, default=d.heads,
                   help=f"attention heads (default {d.heads})")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="key/value heads (default: as many as --heads)")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len,
                   help=f"tokens (bytes) per sequence (default {d.seq_len})")
    p.add_argument("--steps", type=int, default=d.steps,
                   help=f"optimizer steps (default {d.steps})")
    p.add_argument("--lr", type=positive_float, default=d.lr,
                   help=f"AdamW learning rate (default {d.lr:g})")
    p.add_argument("--seed", type=int, default=d.seed, help="init and data seed (default 0)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="parameter dtype")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or a directory (default: the Python standard library)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="checkpoint directory (default runs/train-<time>/)")
    p.add_argument("--timeout", type=positive_float, default=d.timeout,
                   help=f"seconds a rank may wait on a peer before all ranks stop "
                   f"(default {d.timeout:g})")
    p.add_argument("--offload", default=d.offload, metavar="POLICY",
                   help="activation offload: none, stp (the seed's: chunk-0 activations), "
                   "all, selective:X (PipeOffload: cut the peak by about X); default none. "
                   "Every policy measures resident activation bytes per rank")
    p.add_argument("--braid", choices=("on", "off"), default="on",
                   help="run braided blocks unit by unit with the TP all-reduces in flight "
                   "(default on); off: pass by pass, every all-reduce waited for")
    p.add_argument("--trace", default=None, metavar="FILE.json",
                   help="write the last step's measured trace (every unit, all-reduce, send "
                   "and receive of every rank; open in ui.perfetto.dev)")
    p.add_argument("--emulate-compute", default=None, metavar="f=..,b=..,w=..",
                   help="replace each unit's compute by a timed wait: milliseconds of F, B, W "
                   "per microbatch per rank share, as `stp simulate --cost`; communication "
                   "stays real (the loss is not computed)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per step on stdout and nothing else there")
    p.set_defaults(func=run_train)


def _job(args: argparse.Namespace) -> Any:
    from stp.runtime.job import TrainJob

    return TrainJob(
        schedule=args.schedule, pp=args.pp, tp=args.tp, dp=args.dp,
        microbatches=args.microbatches, microbatch_size=args.microbatch_size,
        layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        seq_len=args.seq_len, steps=args.steps, lr=args.lr, seed=args.seed, dtype=args.dtype,
        data=args.data, out=args.out, timeout=args.timeout, offload=args.offload,
        braid=args.braid == "on", trace=args.trace, emulate=args.emulate_compute,
    )


class _Progress:
    """Rank 0's step printer: JSON lines on stdout, or a bar on stderr."""

    def __init__(self, total: int, as_json: bool) -> None:
        self.total, self.as_json = total, as_json
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 20)

    def __call__(self, r: Any) -> None:
        if self.as_json:
            print(json.dumps({"step": r.step, "loss": r.loss, "tokens_per_s": r.tokens_per_s,
                              "step_time_s": r.step_time_s,
                              "resident_activation_bytes": r.resident_activation_bytes}),
                  flush=True)
            return
        done = r.step + 1
        width = 24
        fill = width * done // max(1, self.total)
        line = (f"step {done:>{len(str(self.total))}}/{self.total} "
                f"[{'=' * fill}{' ' * (width - fill)}] loss {r.loss:.4f} | "
                f"{r.tokens_per_s / 1000:.1f}k tok/s | {1000 * r.step_time_s:.0f} ms/step")
        if self.tty:
            end = "\n" if done == self.total else ""
            print("\r" + line, end=end, file=sys.stderr, flush=True)
        elif done % self.every == 0 or done in (1, self.total):
            print(line, file=sys.stderr, flush=True)


def _summary(s: dict[str, Any], as_json: bool) -> None:
    text = (
        f"trained {s['steps']} steps of {s['schedule']} on pp={s['pp']} tp={s['tp']} "
        f"dp={s['dp']} (m={s['microbatches']}, {s['backend']} on {s['device']}, "
        f"{s['parameters']:,} parameters)"
    )
    if s.get("emulate"):
        text += f"\nemulated compute ({s['emulate']} ms): the loss is not computed"
    elif s["first_loss"] is not None:
        text += (f"\nloss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
                 f"{s['tokens_per_s'] / 1000:.1f}k tokens/s, "
                 f"{1000 * s['step_time_s']:.0f} ms/step")
    if s.get("resident_activation_bytes"):
        peaks = ", ".join(f"{b / 2**20:.2f}" for b in s["resident_activation_bytes"])
        text += f"\npeak resident activations per rank (offload {s['offload']}): {peaks} MiB"
    if s.get("trace"):
        text += f"\ntrace of the last step: {s['trace']}"
    text += f"\ncheckpoint: {s['checkpoint']}"
    print(text, file=sys.stderr if as_json else sys.stdout, flush=True)


def _train_here(job: Any, as_json: bool) -> int:
    """Train as one rank of an initialised (or about to be) world; returns the exit status."""
    from stp.runtime import job as jobs
    from stp.runtime.errors import RankError, first_line
    from stp.runtime.launch import init_distributed

    try:
        init_distributed(timeout=job.timeout)
        summary = jobs.run(job, _Progress(job.steps, as_json))
    except (RankError, ValueError) as e:
        print(f"stp: error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        rank = os.environ.get("RANK", "0")
        first = first_line(e)
        print(f"stp: error: rank {rank}: {first}", file=sys.stderr, flush=True)
        return 1
    if summary is not None:
        _summary(summary, as_json)
    return 0


def _worker(job: Any, as_json: bool) -> None:
    """Entry point of a locally launched worker (module level: spawned by name)."""
    code = _train_here(job, as_json)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # Leave at once: tearing down process groups whose peers are gone can block.
        os._exit(code)


def run_train(args: argparse.Namespace) -> int:
    # Before torch loads OpenMP (here and in spawned workers): idle intra-op
    # threads sleep instead of spinning. Spinning threads on shared cores
    # (local workers, other jobs) measured 10-100x slower steps on 2 cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from stp.runtime.launch import in_torchrun, launch_local

    job = _job(args)
    if in_torchrun():
        # Every rank checks; rank 0 alone reports, all exit 2 at once.
        try:
            job.check(world_size=int(os.environ["WORLD_SIZE"]))
        except ValueError as e:
            if os.environ.get("RANK") == "0":
                print(f"stp: error: {e}", file=sys.stderr, flush=True)
            return 2
        code = _train_here(job, args.json)
        if code:
            sys.stderr.flush()
            os._exit(code)
        return 0
    job.check()
    if job.world_size == 1:
        return _train_here(job, args.json)
    result = launch_local(_worker, (job, args.json), job.world_size)
    if result.exitcode:
        print(
            f"stp: error: training stopped: rank(s) {result.failed_ranks} exited with status "
            f"{result.exitcode}", file=sys.stderr, flush=True,
        )
        return 1
    return 0
