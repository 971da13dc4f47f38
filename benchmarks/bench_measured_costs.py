"""The simulator fed with costs measured on this machine, against the measured step.

For each schedule: `stp train --trace` trains a few steps of the byte-level
decoder on pp ranks (gloo workers on the CPU) and writes the last step's
trace; `stp costs` turns the trace into per-stage costs
(`stp.costmodel.measured`); `stp simulate --costs-from` simulates the same
schedule with them. Printed per schedule:

  measured   the traced step's pipeline time: first unit start to last unit
             end over every rank (the executor's run of the schedule)
  step_s     the same step's wall time as `stp train --json` reports it
             (also the optimizer, the loss and gradient-norm all-reduces)
  simulated  the simulated makespan under the measured costs
  error      simulated / measured - 1

The costs come from the same step they predict, so this checks that the
simulator's model (passes, dependencies, send latency, per-stage times)
reproduces the runtime's timeline, not that one step predicts the next; on
a shared CPU the step times themselves vary by 10% and more from step to step.

    python3 benchmarks/bench_measured_costs.py [--schedules 1f1b,zb-h1,zb-v]
        [--pp 2] [--steps 6] [--hidden 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _stp(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "stp.cli.main", *argv], capture_output=True,
                         text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"stp {' '.join(argv)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def _traced_span(trace: Path) -> float:
    """Milliseconds from the first unit start to the last unit end of the trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    units = [e for e in events if e.get("cat") == "compute"]
    start = min(e["ts"] for e in units)
    return (max(e["ts"] + e["dur"] for e in units) - start) / 1e3


def measure(schedule: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    trace, out = tmp / f"{schedule}.json", tmp / f"run-{schedule}"
    rows = _stp("train", "--schedule", schedule, "--pp", str(args.pp), "--steps",
                str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers),
                "--seq-len", str(args.seq_len), "-m", str(args.microbatches), "--trace",
                str(trace), "--out", str(out), "--json")
    steps = [json.loads(line) for line in rows.splitlines() if line.startswith("{")]
    sim = json.loads(_stp("simulate", "--schedule", schedule, "--pp", str(args.pp), "-m",
                          str(args.microbatches), "--costs-from", str(trace), "--json"))
    measured = _traced_span(trace)
    return {"schedule": schedule, "measured_ms": measured,
            "step_ms": 1e3 * steps[-1]["step_s"], "simulated_ms": sim["makespan"],
            "error": sim["makespan"] / measured - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,zb-h1,zb-v")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(s, args, Path(tmp)) for s in args.schedules.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"pp={args.pp} m={args.microbatches} layers={args.layers} hidden={args.hidden} "
          f"seq={args.seq_len}, {args.steps} steps, the last one traced (ms)")
    print(f"{'schedule':<10} {'measured':>9} {'step_s':>9} {'simulated':>10} {'error':>7}")
    for r in rows:
        print(f"{r['schedule']:<10} {r['measured_ms']:>9.1f} {r['step_ms']:>9.1f} "
              f"{r['simulated_ms']:>10.1f} {r['error']:>+7.1%}")


if __name__ == "__main__":
    main()
