"""Start-up of `stp train`, measured: build time and time to first step, for one or
more source trees (before / after a change), rounds alternating.

    PYTHONPATH=src python benchmarks/bench_startup.py --tree after=src \\
        --tree before=/tmp/base/src --rounds 3 --out benchmarks/results/startup.json

For each tree, in a fresh process per measurement:

  build   the seconds (wall, and the process's CPU time, steadier on a shared
          machine) to build and initialise TP rank 0's stage of the whole model
          (`build_stage(config, StagePlacement(0, 1, tp_size=t))`, an identity all-reduce),
          at each `--tp`: what one rank of a t-way run spends making its parameters;
  ttfs    time to first step of `stp train <flags> --steps 2 --json` (stp.train.run.startup's
          definition): from the spawn of the process to its first step's JSON row
          (step 2, the last, writes the checkpoint: not timed),
          timed by this script (the same clock for every tree, whether or not the
          tree reports its own start-up), plus the run's own start-up parts when it
          records them.

Medians over `--rounds`; every round runs every tree once, in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BUILD = r"""
import sys, time, torch
from stp.models import ModelConfig, StagePlacement, build_stage
layers, hidden, heads, tp = (int(a) for a in sys.argv[1:5])
cfg = ModelConfig(num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=heads,
                  max_seq_len=64)
t, c = time.perf_counter(), time.process_time()
stage = build_stage(cfg, StagePlacement(0, 1, tp_size=tp), allreduce=lambda x: x)
took, cpu = time.perf_counter() - t, time.process_time() - c
n = sum(p.numel() for p in stage.parameters())
print(took, cpu, n)
"""


def _env(tree: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}


def build_seconds(tree: str, layers: int, hidden: int, heads: int,
                  tp: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, parameters) of TP rank 0's whole-model stage at tp,
    built in a fresh process from `tree` (CPU seconds: steadier on a shared machine)."""
    out = subprocess.run([sys.executable, "-c", BUILD, str(layers), str(hidden), str(heads),
                          str(tp)], capture_output=True, text=True, env=_env(tree), check=True)
    took, cpu, n = out.stdout.split()
    return float(took), float(cpu), int(n)


def first_step(tree: str, flags: list[str], out_dir: Path) -> dict[str, object]:
    """Seconds from spawning `stp train` to its first step's JSON row, the run's own
    start-up parts (None when the tree records none)."""
    # two steps: the last step of a run also writes its checkpoint before its row
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *flags, "--steps", "2", "--json",
           "--out", str(out_dir)]
    began = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(tree))
    assert proc.stdout is not None
    row: dict[str, object] = {}
    for line in proc.stdout:
        if '"loss"' in line:
            seen = time.time() - began
            row = json.loads(line)
            break
    proc.wait()
    if not row or proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode})")
    return {"ttfs_s": seen, "step_s": row["step_s"], "startup": row.get("startup")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True,
                    help="NAME=SRC: a source tree (the directory holding stp), repeatable")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tp", type=int, action="append", default=None,
                    help="TP sizes (repeatable; default 1 and 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-train", action="store_true", help="build times only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    tps = args.tp or [1, 2]
    model = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads",
             str(args.heads), "--seq-len", "32", "--microbatch-size", "1", "-m", "2",
             "--pp", "1", "--schedule", "1f1b", "--timeout", "600"]
    runs = {f"tp{t}": [*model, "--tp", str(t)] for t in tps}
    results: dict[str, dict[str, list]] = {name: {} for name in trees}
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_startup_{os.getpid()}"
    for r in range(args.rounds):
        for name, tree in trees.items():
            res = results[name]
            for t in tps:
                took, cpu, n = build_seconds(tree, args.layers, args.hidden, args.heads, t)
                res.setdefault(f"build_tp{t}_s", []).append(took)
                res.setdefault(f"build_cpu_tp{t}_s", []).append(cpu)
                res[f"parameters_tp{t}"] = [n]
            if not args.skip_train:
                for key, flags in runs.items():
                    got = first_step(tree, flags, scratch / f"{name}-{key}-{r}")
                    res.setdefault(f"ttfs_{key}_s", []).append(got["ttfs_s"])
                    res.setdefault(f"step1_{key}_s", []).append(got["step_s"])
                    if got["startup"] is not None:
                        res.setdefault(f"startup_{key}", []).append(got["startup"])
            print(f"round {r + 1}: {name} " + json.dumps(
                {k: v[-1] for k, v in res.items() if not k.startswith("startup")}), flush=True)
    summary = {"model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads},
               "flags": model, "rounds": args.rounds, "trees": {}}
    for name, res in results.items():
        med = {k: statistics.median(v) for k, v in res.items()
               if not k.startswith("startup")}
        for k, v in res.items():
            if k.startswith("startup"):
                med[k] = {p: statistics.median(s[p] for s in v) for p in v[0]}
        summary["trees"][name] = {"median": med, "all": res}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
