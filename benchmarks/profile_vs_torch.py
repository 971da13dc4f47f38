"""Where the time goes, stp against torch pipelining, compiled: torch.profiler per
rank on both sides of the peer benchmark (stp.bench.peer_profile says what
each column holds).

For each size and setting (tp1/tp2 compiled by default) and schedule, one
launch of pp x tp gloo ranks builds both sides as `benchmarks/bench_vs_torch.py`
does, compiles and warms them up, times `--rounds` unprofiled steps of each
(CPU ms per step per rank) and profiles `--steps` more; the table gives per
side and rank the milliseconds per step in matmuls, attention, inductor's
kernels, compile glue (TorchDynamo / AOTAutograd per call), other aten ops,
the autograd engine, collectives and their waits, p2p waits, and the rest
(Python, dispatcher), with aten ops, compiled-graph calls and autograd nodes
per step.

    PYTHONPATH=src python3 benchmarks/profile_vs_torch.py [--sizes overhead,compute]
        [--settings tp1-compiled,tp2-compiled] [--schedules 1f1b,1f1b-interleaved]
        [--steps 3] [--rounds 3] [--top 0] [--out FILE.md]

Sizes as in bench_vs_torch.py (8 layers, microbatch size 4, m=8, float32):
overhead = hidden 64, seq 128; compute = hidden 512, seq 256 (issue = 256, 128).
--top N prints each side's N largest event names per bucket on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from bench_vs_torch import SETTINGS, SIZES, check_choices, model_of  # noqa: E402


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="overhead,compute")
    p.add_argument("--settings", default="tp1-compiled,tp2-compiled")
    p.add_argument("--schedules", default="1f1b,1f1b-interleaved")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--top", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)
    check_choices(p, args)
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps and --rounds must be >= 1, got {args.steps}, {args.rounds}")
    return args


def main(argv: list[str]) -> int:
    args = _args(argv)
    from stp.bench.peer import PeerSpec
    from stp.bench.peer_profile import ProfileSpec, format_breakdown, run_profile

    sections = []
    for size in args.sizes.split(","):
        shape = SIZES[size]
        model = model_of(size, args.layers)
        tables = []
        for setting in args.settings.split(","):
            tp, compiled = SETTINGS[setting]
            for schedule in args.schedules.split(","):
                peer = PeerSpec(schedules=(schedule,), tp=tp, compile=compiled, model=model,
                                seq_len=shape["seq_len"], microbatches=args.microbatches,
                                csv=False, memory=False, pairs=1, warmup=2)
                start = time.perf_counter()
                result = run_profile(ProfileSpec(peer, steps=args.steps, rounds=args.rounds))
                table = format_breakdown(result)
                print(f"## {size}, {setting}, {schedule} "
                      f"({time.perf_counter() - start:.0f} s)\n\n{table}\n", flush=True)
                tables.append(table)
                if args.top:
                    _print_top(result, schedule, args.top)
        sections.append(f"### {size} (hidden {shape['hidden']}, seq {shape['seq_len']})\n\n"
                        + "\n\n".join(tables) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"`python3 benchmarks/profile_vs_torch.py {' '.join(argv)}`\n\n"
                    + "\n".join(sections))
        print(f"wrote {args.out}")
    return 0


def _print_top(result: dict, schedule: str, top: int) -> None:
    for r, ranks in enumerate(result["ranks"]):
        for side, d in ranks[schedule]["sides"].items():
            print(f"#### rank {r}, {side}: largest self times (ms per step)")
            for name, ms in d["top"][:top]:
                print(f"    {ms:8.2f}  {name}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
