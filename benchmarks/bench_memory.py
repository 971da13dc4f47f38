"""`stp memory` against what `stp train` measured, per category, on small runs.

For each configuration: `stp train FLAGS --steps 2 --json` (its closing
object holds every rank's measured bytes, stp.train.run.memory_measure) and
`stp memory FLAGS --json` (the estimate `stp train` checks before launching,
stp.train.run.memory_check.run_estimate) with the same flags. Printed per
configuration: estimated / measured bytes of the measured peak rank, per
category, and the relative error of the total. The total compared is over
the categories both sides count (weights, grads, masters, optimizer,
activations_peak, and dp_copies: what the DP reductions' flat gradient
copies in flight add to the peak of resident activations, a part of the
estimate's `buffers`, measured with the overlap on): the rest of `buffers`
(point-to-point and gathered inputs) is not measured, and is shown apart.
A markdown table goes to
benchmarks/results/memory.md.

    PYTHONPATH=src python3 benchmarks/bench_memory.py            # every row, ~10 min on 2 cores
    PYTHONPATH=src python3 benchmarks/bench_memory.py --only stp-tp2-sp,1f1b

Rows whose flag `stp train` does not have yet (--recompute, --shard-optimizer)
are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MODEL = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "128"]
"""A model that trains in seconds on a laptop; activations dominate its bytes."""

MOE = ["--arch", "moe", "--experts", "4", "--top-k", "2", "--expert-ffn", "256",
       "--shared-expert-ffn", "128"]
"""The mixture of experts on the same attention (ep 1: the runtime had no --ep when
its rows were measured)."""

MLLM = ["--arch", "mllm", "--vision-hidden", "64", "--vision-heads", "4"]
"""The multimodal model on the same decoder: merge**2 x the encoder width is the decoder's
(its units' image rows are views of the packed stream, stp.costmodel.mllm.memory); the
`-narrow` rows keep the default encoder width 16 (the rows are copies)."""

CONFIGS: dict[str, list[str]] = {
    "1f1b": ["--pp", "2", "--schedule", "1f1b"],
    "zb-v": ["--pp", "2", "--schedule", "zb-v"],
    "stp": ["--pp", "2", "--schedule", "stp"],
    "dualpipev": ["--pp", "2", "--schedule", "dualpipev"],
    "stp-tp2": ["--pp", "2", "--tp", "2", "--schedule", "stp"],
    "stp-tp2-sp": ["--pp", "2", "--tp", "2", "--schedule", "stp", "--sequence-parallel"],
    "1f1b-dp2-bf16": ["--pp", "2", "--dp", "2", "--schedule", "1f1b", "--dtype", "bfloat16"],
    "zb-v-tp2-bf16": ["--pp", "2", "--tp", "2", "--schedule", "zb-v", "--dtype", "bfloat16"],
    "stp-offload-stp": ["--pp", "2", "--schedule", "stp", "--offload", "stp"],
    "zb-v-offload-all": ["--pp", "2", "--schedule", "zb-v", "--offload", "all"],
    "1f1b-recompute-selective": ["--pp", "2", "--schedule", "1f1b", "--recompute", "selective"],
    "stp-recompute-full": ["--pp", "2", "--schedule", "stp", "--recompute", "full"],
    "1f1b-recompute-full": ["--pp", "2", "--schedule", "1f1b", "--recompute", "full"],
    "zb-v-tp2-sp-recompute-full": ["--pp", "2", "--tp", "2", "--schedule", "zb-v",
                                   "--sequence-parallel", "--recompute", "full"],
    "zb-v-dp2-bf16-overlap": ["--pp", "2", "--dp", "2", "--schedule", "zb-v",
                              "--dtype", "bfloat16", "--overlap-grad-sync", "on"],
    "zb-v-dp2-bf16-seq16": ["--pp", "2", "--dp", "2", "--schedule", "zb-v", "--dtype",
                            "bfloat16", "--seq-len", "16"],
    "zb-v-dp2-fp32-seq16": ["--pp", "2", "--dp", "2", "--schedule", "zb-v", "--dtype",
                            "float32", "--seq-len", "16"],
    "1f1b-dp2-shard-optimizer": ["--pp", "2", "--dp", "2", "--schedule", "1f1b",
                                 "--dtype", "bfloat16", "--shard-optimizer"],
    "moe-1f1b": ["--pp", "2", "--schedule", "1f1b", *MOE],
    "moe-stp": ["--pp", "2", "--schedule", "stp", *MOE],
    "moe-stp-tp2": ["--pp", "2", "--tp", "2", "--schedule", "stp", *MOE],
    "mllm-1f1b": ["--pp", "2", "--schedule", "1f1b", *MLLM],
    "mllm-stp": ["--pp", "2", "--schedule", "stp", *MLLM],
    "mllm-stp-tp2": ["--pp", "2", "--tp", "2", "--schedule", "stp", *MLLM],
    "mllm-zb-v-narrow-bf16": ["--pp", "2", "--schedule", "zb-v", "--arch", "mllm",
                              "--dtype", "bfloat16"],
    "mllm-stp-tp2-narrow": ["--pp", "2", "--tp", "2", "--schedule", "stp", "--arch", "mllm"],
    "mllm-stp-tp2-sp": ["--pp", "2", "--tp", "2", "--schedule", "stp", "--sequence-parallel",
                        *MLLM],
    "mllm-zb-v-recompute-full": ["--pp", "2", "--schedule", "zb-v", "--recompute", "full",
                                 *MLLM],
    "zb-v-compile": ["--pp", "2", "--schedule", "zb-v", "--compile"],
    "stp-tp2-compile": ["--pp", "2", "--tp", "2", "--schedule", "stp", "--compile"],
}
NEEDS = {"--recompute": "recompute", "--shard-optimizer": "shard_optimizer",
         "--compile": "compile"}
"""Flags other work adds to `stp train`, and the TrainJob field that shows it has."""

INSTANT_HOST = ["--hardware", "a100-80g,host_bandwidth=1e15"]
"""The CPU runtime copies offloaded activations synchronously (stp.runtime.offload's
HostCopier): the estimate is asked for an instant host link. On an A100's link this
small model's copies outlast its compute and offload would save nothing."""

CATEGORIES = ("weights", "grads", "masters", "optimizer", "activations_peak", "dp_copies")
TARGET = 0.10


def missing_flag(flags: list[str]) -> str | None:
    """The first flag of `flags` that `stp train` does not have yet."""
    from stp.train.run.config import TrainJob

    fields = {f.name for f in dataclasses.fields(TrainJob)}
    return next((f for f in flags if f in NEEDS and NEEDS[f] not in fields), None)


def _stp(argv: list[str], cwd: str) -> dict[str, Any]:
    """The last JSON object `stp ARGV` prints on stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if env.get("PYTHONPATH"):  # the runs start in a temporary directory: `src` must still resolve
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    done = subprocess.run([sys.executable, "-m", "stp", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"stp {' '.join(argv)}: exit {done.returncode}: "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(flags: list[str], steps: int = 2) -> dict[str, Any]:
    """Estimated and measured bytes of the measured peak pipeline rank."""
    with tempfile.TemporaryDirectory() as tmp:
        measured = _stp(["train", *MODEL, *flags, "--steps", str(steps), "--json",
                         "--out", str(Path(tmp) / "run")], tmp)
        est = _stp(["memory", *MODEL, *flags, *INSTANT_HOST, "--json"], tmp)
    by_pp: dict[int, dict[str, int]] = {}
    for r in measured["ranks"]:  # the heaviest TP x DP peer of each pipeline rank
        if r["pp"] not in by_pp or r["total"] > by_pp[r["pp"]]["total"]:
            by_pp[r["pp"]] = r
    rank = measured["peak_rank"]
    mine = next(r for r in est["ranks"] if r["rank"] == rank)
    est_total = sum(mine.get(k, 0) for k in CATEGORIES)
    meas_total = sum(by_pp[rank].get(k, 0) for k in CATEGORIES)
    every = [sum(e.get(k, 0) for k in CATEGORIES)
             / sum(by_pp[e["rank"]].get(k, 0) for k in CATEGORIES) - 1 for e in est["ranks"]]
    return {"rank": rank, "estimated": {k: mine.get(k, 0) for k in CATEGORIES},
            "measured": {k: by_pp[rank].get(k, 0) for k in CATEGORIES},
            "buffers": mine["buffers"] - mine.get("dp_copies", 0),
            "est_total": est_total, "meas_total": meas_total,
            "error": est_total / meas_total - 1, "est_peak_rank": est["peak_rank"],
            "worst_rank_error": max(every, key=abs)}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: dict[str, dict[str, Any]], skipped: dict[str, str]) -> str:
    head = ["config", "rank", *CATEGORIES, "total", "error", "any rank's error",
            "buffers (est. only)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        cells = [f"{_mib(r['estimated'][k])} / {_mib(r['measured'][k])}" for k in CATEGORIES]
        lines.append("| " + " | ".join([
            f"`{name}`", str(r["rank"]), *cells,
            f"{_mib(r['est_total'])} / {_mib(r['meas_total'])}", f"{100 * r['error']:+.1f}%",
            f"{100 * r['worst_rank_error']:+.1f}%", _mib(r["buffers"])]) + " |")
    for name, flag in skipped.items():
        lines.append(f"| `{name}` | skipped: `stp train` has no `{flag}` yet |"
                     + " |" * (len(head) - 2))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated config names")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.md"))
    args = ap.parse_args()
    names = list(CONFIGS) if args.only is None else args.only.split(",")
    rows: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        flags = CONFIGS[name]
        flag = missing_flag(flags)
        if flag is not None:
            print(f"{name}: skipped, `stp train` has no {flag} yet", flush=True)
            skipped[name] = flag
            continue
        r = rows[name] = compare(flags, args.steps)
        cats = ", ".join(f"{k} {_mib(r['estimated'][k])}/{_mib(r['measured'][k])}"
                         for k in CATEGORIES)
        print(f"{name}: rank {r['rank']} (est. peak rank {r['est_peak_rank']}) MiB est/meas: "
              f"{cats}; total {_mib(r['est_total'])}/{_mib(r['meas_total'])} "
              f"({100 * r['error']:+.1f}%; worst pipeline rank "
              f"{100 * r['worst_rank_error']:+.1f}%); buffers {_mib(r['buffers'])} (est. only)",
              flush=True)
    text = (f"# `stp memory` against `stp train`'s measurement\n\n"
            f"`PYTHONPATH=src python3 benchmarks/bench_memory.py` (model: `{' '.join(MODEL)}`, "
            f"default -m and microbatch size, {args.steps} steps, CPU, gloo; the estimate with "
            f"`{' '.join(INSTANT_HOST)}`: the CPU runtime's offload copies are synchronous). "
            "Each cell: "
            "estimated / measured MiB of the pipeline rank that measured the most; error: "
            "of the total over the six measured categories (target: within "
            f"{100 * TARGET:.0f}%); any rank's error: the largest over the pipeline ranks "
            "(each its heaviest TP x DP peer). `buffers` are estimated only (module "
            "doc).\n\n"
            + table(rows, skipped) + "\n")
    if args.only is None:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    worst = max((abs(r["error"]) for r in rows.values()), default=0.0)
    print(f"worst total error {100 * worst:.1f}% (target {100 * TARGET:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
