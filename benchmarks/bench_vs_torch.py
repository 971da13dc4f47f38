"""stp's runtime against PyTorch's `torch.distributed.pipelining`, side by side.

Same decoder, batch, dtype, microbatches and schedule on both runtimes, pp=2,
gloo on the CPU (stp.bench.peer has the details): stp's Trainer step against
PyTorch's schedule class of the same name, and against `_PipelineScheduleRuntime`
running stp's exported CSV (the exact same order, eager settings only).
Steps alternate stp, torch, torch-csv, ... in one process group, so a shared
machine's drift hits every side; a ratio stp / torch below 1 means stp is faster.

Settings (one launch each, rows labelled so in the tables):
  tp1-eager     pp=2 x tp=1, 2 processes, torch's plain module
  tp1-compiled  both compiled: torch per block (torchtitan's way), stp --compile
  tp2-eager     pp=2 x tp=2, 4 processes, torch's DTensor TP per block (torchtitan's
                plan) under its pipelining schedule
  tp2-compiled  the same, compiled
stp's compile is its Trainer option `compile`; a build without it prints
"stp --compile not available in this build" in the stp column.

Three sizes by default (8 layers, microbatch size 4, m=8, float32):
  issue     hidden 256, seq 128  (the first hand-made measurement's size)
  compute   hidden 512, seq 256  (compute dominates)
  overhead  hidden 64,  seq 128  (per-unit Python overhead dominates)

    python3 benchmarks/bench_vs_torch.py [--sizes issue,compute,overhead] [--rounds 7]
        [--settings tp1-eager,tp1-compiled,tp2-eager,tp2-compiled]
        [--schedules 1f1b,1f1b-interleaved,zb-v] [--profile-rank R] [--out FILE.md]

Prints the tables; writes them to benchmarks/results/vs_torch.md (with the
command) only for a full run, or to --out FILE when given. A run with --no-csv
(a partial table) or --no-write leaves every results file alone, so a
measurement never overwrites the recorded one. --profile-rank prints each
side's cProfile top entries on that rank (extra, untimed rounds).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

SIZES = {
    "issue": {"hidden": 256, "seq_len": 128},
    "compute": {"hidden": 512, "seq_len": 256},
    "overhead": {"hidden": 64, "seq_len": 128},
}
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "vs_torch.md")
SETTINGS = {"tp1-eager": (1, False), "tp1-compiled": (1, True),
            "tp2-eager": (2, False), "tp2-compiled": (2, True)}


def check_choices(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (argparse's error) on a size or setting not in SIZES / SETTINGS."""
    for value, known, what in ((args.sizes, SIZES, "size"), (args.settings, SETTINGS, "setting")):
        bad = [s for s in value.split(",") if s not in known]
        if bad:
            p.error(f"unknown {what} {bad[0]!r}; choose from {', '.join(known)}")


def model_of(size: str, layers: int):  # -> stp.shapes.ModelConfig (imported late: argparse first)
    """The decoder of a named size (SIZES), 4 heads, `layers` layers."""
    from stp.shapes import ModelConfig

    shape = SIZES[size]
    return ModelConfig(hidden=shape["hidden"], num_layers=layers, num_heads=4, num_kv_heads=4,
                       max_seq_len=shape["seq_len"])


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="issue,compute,overhead",
                   help=f"comma-separated from {', '.join(SIZES)} (default all)")
    p.add_argument("--schedules", default="1f1b,1f1b-interleaved,zb-v")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per schedule (>= 5)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated from {', '.join(SETTINGS)} (default all)")
    p.add_argument("--no-csv", action="store_true",
                   help="skip the CSV-order runs (and, without --out, write no file)")
    p.add_argument("--no-write", action="store_true",
                   help="print the tables only, write no file (even with --out)")
    p.add_argument("--profile-rank", type=int, default=None)
    p.add_argument("--out", default=None,
                   help=f"write the tables here (default {DEFAULT_OUT} for a full run)")
    args = p.parse_args(argv)
    check_choices(p, args)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def out_file(args: argparse.Namespace) -> str | None:
    """Where the tables go: --out, else the recorded results for a full run (with the
    CSV-order rows); None (print only) for --no-write or a --no-csv run without --out."""
    if args.no_write:
        return None
    if args.out is not None:
        return args.out
    return None if args.no_csv else DEFAULT_OUT


def main(argv: list[str]) -> int:
    args = _args(argv)
    from stp.bench.peer import PeerSpec, run_peer
    from stp.bench.peer_table import failed_setting, format_tables

    sections = []
    for size in args.sizes.split(","):
        shape = SIZES[size]
        model = model_of(size, args.layers)
        results = []
        for setting in args.settings.split(","):
            tp, compiled = SETTINGS[setting]
            spec = PeerSpec(
                schedules=tuple(args.schedules.split(",")), tp=tp, compile=compiled,
                model=model, seq_len=shape["seq_len"], microbatch_size=args.microbatch_size,
                microbatches=args.microbatches, pairs=args.rounds,
                csv=not args.no_csv and not compiled, profile_rank=args.profile_rank,
            )
            start = time.perf_counter()
            try:
                result = run_peer(spec)
            except RuntimeError as e:  # one setting failing is a row, not the end
                result = failed_setting(spec, f"run failed: {e}")
            results.append(result)
            print(f"## {size}, {spec.label}\n\n{format_tables([result])}\n"
                  f"({time.perf_counter() - start:.0f} s)\n", flush=True)
            for schedule, sides in result.get("profiles", {}).items():
                for side, text in sides.items():
                    print(f"### cProfile, {spec.label}, rank {args.profile_rank}, {schedule}, "
                          f"{side}\n{text}")
        sections.append(f"## {size}\n\n{format_tables(results)}\n")
    command = "python3 benchmarks/bench_vs_torch.py " + " ".join(argv)
    header = (
        "# stp vs torch.distributed.pipelining\n\n"
        f"`{command.strip()}` on a machine with {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), "
        f"{time.strftime('%Y-%m-%d')}. Step = zero grads, m microbatches, loss all-reduce, "
        "SGD step, global gradient norm; ms are medians over rounds; ratios stp/torch per round "
        "(below 1: stp faster); peak MiB: resident growth during one step, per rank. "
        "What the ratios come from: docs/performance.md, "
        "\"Against torch.distributed.pipelining\".\n"
    )
    out = out_file(args)
    if out is None:
        print("wrote no file (--no-csv or --no-write; --out FILE writes one)")
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(header + "\n" + "\n".join(sections))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
