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
  error      simulated / measured - 1 (and / step_s - 1)
  cross      the simulated makespan under the costs measured in the run of
             the other schedule with as many stages (1f1b <-> zb-h1: two,
             zb-v <-> stp: four), and its error against this run's measured

`simulated` takes its costs from the step it predicts, so it checks that the
simulator's model (passes, dependencies, send latency, per-stage times)
reproduces the runtime's timeline; `cross` predicts one schedule's step from
another's run. On a shared CPU the step times themselves vary by 10% and
more from run to run (other processes take the cores), which `cross` carries.

    python3 benchmarks/bench_measured_costs.py [--schedules 1f1b,zb-h1,zb-v]
        [--pp 2] [--steps 4] [--hidden 128] [--keep DIR] [--out FILE.md] [--json]
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

PARTNER = {"1f1b": "zb-h1", "zb-h1": "1f1b", "zb-v": "stp", "stp": "zb-v"}
"""Schedules with as many global stages at any pp: each predicted from the other's run."""


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
    steps = [r for r in (json.loads(line) for line in rows.splitlines() if line.startswith("{"))
             if "loss" in r]
    measured = _traced_span(trace)
    simulated = _simulate(schedule, args, trace)
    return {"schedule": schedule, "trace": str(trace), "measured_ms": measured,
            "step_ms": 1e3 * steps[-1]["step_s"], "simulated_ms": simulated,
            "error": simulated / measured - 1,
            "error_step": simulated / (1e3 * steps[-1]["step_s"]) - 1}


def _simulate(schedule: str, args: argparse.Namespace, trace: Path | str) -> float:
    sim = json.loads(_stp("simulate", "--schedule", schedule, "--pp", str(args.pp), "-m",
                          str(args.microbatches), "--costs-from", str(trace), "--json"))
    return float(sim["makespan"])


def cross(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each schedule simulated with its partner's measured costs (PARTNER)."""
    by_name = {r["schedule"]: r for r in rows}
    for r in rows:
        other = by_name.get(PARTNER.get(r["schedule"], ""))
        if other is not None:
            r["cross_ms"] = _simulate(r["schedule"], args, other["trace"])
            r["cross_error"] = r["cross_ms"] / r["measured_ms"] - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,zb-h1,zb-v,stp")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--keep", metavar="DIR", default=None, help="keep the traces in DIR")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", metavar="FILE.md", default=None, help="also write the table")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        rows = [measure(s, args, where) for s in args.schedules.split(",")]
        cross(rows, args)
    if args.json:
        print(json.dumps(rows))
        return
    text = "\n".join(report(rows, args))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The table as Markdown."""
    out = [f"pp={args.pp}, m={args.microbatches}, {args.layers} layers, hidden {args.hidden}, "
           f"sequence {args.seq_len}, {args.steps} steps, the last one traced; times in ms; "
           f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", "",
           "| schedule | measured | step_s | simulated | error | vs step_s | cross | error |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cross_ms = f"{r['cross_ms']:.1f} | {r['cross_error']:+.1%}" if "cross_ms" in r else "- | -"
        out.append(f"| {r['schedule']} | {r['measured_ms']:.1f} | {r['step_ms']:.1f} | "
                   f"{r['simulated_ms']:.1f} | {r['error']:+.1%} | {r['error_step']:+.1%} | "
                   f"{cross_ms} |")
    return out


if __name__ == "__main__":
    main()
