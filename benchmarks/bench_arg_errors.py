"""How long `stp train` / `stp memory` take to answer: a refused argument, and
`stp memory` on the toy model (benchmarks/results/startup.md, "Argument errors and
stp memory").

    PYTHONPATH=$PWD/src python3 benchmarks/bench_arg_errors.py [--src DIR] [--repeat 3]

Each command runs in a fresh interpreter (`main([...])` of the stp under --src,
default this checkout's src/), `--repeat` times; printed: the median wall seconds,
the median CPU seconds of the child (user + system: what a loaded machine does not
stretch), its exit status and whether torch was imported.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = (
    ["train", "--tp", "3"],
    ["train", "--data", "/nonexistent"],
    ["memory", "--tp", "3"],
    ["memory"],
)

CODE = ("import sys; from stp.cli.main import main; rc = main(sys.argv[1:]); "
        "print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)")


def _once(src: str, argv: list[str]) -> tuple[float, float, int, bool]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CODE, *argv], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": src})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    torch = out.stderr.strip().splitlines()[-1] == "True"
    return wall, cpu, out.returncode, torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for argv in COMMANDS:
        runs = [_once(args.src, argv) for _ in range(args.repeat)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"stp {' '.join(argv):<32} wall {wall:6.2f} s  cpu {cpu:5.2f} s  "
              f"exit {runs[0][2]}  torch imported: {runs[0][3]}", flush=True)


if __name__ == "__main__":
    main()
