"""Is `stp plan`'s ranking right on this machine? Plan, then run the plans.

    PYTHONPATH=src python3 benchmarks/bench_plan_local.py [--rounds 3] [--steps 6]

1. Hardware: `--hardware local` (`stp.cli.plan.local_hardware`: a short
   traced pp 2 x tp 2 run, fitted by `stp.plan.calibrate`) gives this
   machine's TP all-reduce and send latency. Compute is emulated
   (`stp train --emulate-compute`: each unit waits instead of computing,
   communication stays real), so that 4 ranks do not fight over 2 cores:
   the emulated speed is the planner's own (a layer's forward of one
   sequence takes `--layer-ms`), and what is checked is everything else
   the planner predicts: bubbles, exposed TP all-reduces, sends, the DP
   sync and the microbatching.
2. Plan a small decoder (8 layers, hidden 64, 4 heads, 64 tokens; global
   batch 16) on 4 processes across every mesh, schedule and microbatching
   (`stp.plan`, float32, even partition: emulated stages take none).
3. Run the planner's top 3 (of distinct predicted steps: configurations it
   prices the same are one choice) and 3 configurations spread over its bottom half
   with `stp train --emulate-compute` for `--rounds` rounds, alternating the
   order each round; a configuration's time is the median over rounds of
   its per-run median step (the first step left out).
4. Print predicted against measured, whether the measured best is the
   planner's choice or within 5% of it, and Spearman's rank correlation.

Timings on a shared machine are noisy: say how loaded it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

from stp.cli.plan import local_hardware
from stp.costmodel.decoder.costs import derive_decoder
from stp.costmodel.decoder.spec import ModelSpec, layer_flops
from stp.plan import PlanRequest, plan
from stp.plan.price import Priced, spec_for
from stp.plan.report import schedule_file
from stp.schedule import generate
from stp.schedule.io import dump_json

LAYERS, HIDDEN, HEADS, SEQ, BATCH, GPUS = 8, 64, 4, 64, 16, 4
MODEL = ModelSpec(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=HEADS, ffn=4 * HIDDEN,
                  vocab=1, sequence=SEQ, flash_attention=True, dropout=False, name="emulated")
"""vocab 1: emulated stages have no embedding or output layer to price."""


def _hardware(layer_ms: float):
    local = local_hardware()
    f = layer_flops(replace(MODEL, tp=1, micro_batch=1))[0]
    achieved = f / (layer_ms / 1e3)
    return replace(local, peak_flops=achieved, efficiency=1.0, name="local+emulated")


def _emulate(p: Priced, hardware) -> str:
    c = derive_decoder(spec_for(MODEL, p.config, SEQ), hardware, p.config.mesh.pp).costs
    return f"f={c.f:.4f},b={c.b:.4f},w={c.w:.4f}"


def _schedule_arg(p: Priced, tmp: str) -> str:
    """The schedule name, or for v != 2 chunks (stp train has no --chunks) the
    schedule file that runs it (`stp.plan.report.schedule_file`)."""
    c = p.config
    name = schedule_file(p)
    if name is None:
        return c.schedule
    path = os.path.join(tmp, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(dump_json(generate(c.schedule, c.mesh.pp, c.microbatches, **c.options())))
    return path


def _run(p: Priced, hardware, steps: int, tmp: str) -> float:
    c = p.config
    cmd = [sys.executable, "-m", "stp", "train", "--pp", str(c.mesh.pp), "--tp",
           str(c.mesh.tp), "--dp", str(c.mesh.dp), "--schedule", _schedule_arg(p, tmp), "-m",
           str(c.microbatches), "--microbatch-size", str(c.microbatch_size), "--layers",
           str(LAYERS), "--hidden", str(HIDDEN), "--heads", str(HEADS), "--seq-len", str(SEQ),
           "--steps", str(steps), "--emulate-compute", _emulate(p, hardware), "--json",
           "--out", tempfile.mkdtemp(dir=tmp), "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[3:])}: {done.stderr.strip()[-300:]}")
    rows = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    times = [r["step_s"] for r in rows if "step_s" in r][1:]
    return statistics.median(times)


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0.0] * len(xs)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def _name(p: Priced) -> str:
    c = p.config
    v = f" v{c.chunks}" if c.chunks is not None else ""
    return (f"pp{c.mesh.pp} tp{c.mesh.tp} dp{c.mesh.dp} {c.schedule}{v} "
            f"b{c.microbatch_size} m{c.microbatches}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layer-ms", type=float, default=2.0,
                    help="emulated forward of one layer for one sequence, ms (default 2)")
    ap.add_argument("--dry-run", action="store_true",
                    help="plan and print the picks and their --emulate-compute, run nothing")
    args = ap.parse_args()
    hardware = _hardware(args.layer_ms)
    print(f"hardware: tp_latency {hardware.tp_latency * 1e6:.0f} us, pp_latency "
          f"{hardware.pp_latency * 1e6:.0f} us (local calibration); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    request = PlanRequest(model=MODEL, hardware=hardware, gpus=GPUS, global_batch=BATCH,
                          seq_len=SEQ, gpus_per_node=GPUS, dtype="float32", top=1000,
                          partition="even", allow_sequence_parallel=False,
                          allow_offload=False, max_microbatch_size=4)
    # Plans the planner prices the same (at pp 1, 1F1B, interleaved 1F1B and
    # ZB-H1 are one computation) are one choice: keep the first of each price.
    ranked = []
    for p in plan(request).plans:
        if not ranked or p.step_s > ranked[-1].step_s * (1 + 1e-6):
            ranked.append(p)
    half = ranked[len(ranked) // 2:]
    picks = ranked[:3] + [half[i * (len(half) - 1) // 2] for i in range(3)]
    print(f"{len(ranked)} plans; running #1-3 and #"
          + ", #".join(str(ranked.index(p) + 1) for p in picks[3:]), flush=True)
    if args.dry_run:
        for p in picks:
            print(f"  #{ranked.index(p) + 1} {_name(p)}: predicted {p.step_s * 1e3:.1f} ms, "
                  f"--emulate-compute {_emulate(p, hardware)}")
        return
    measured: dict[int, list[float]] = {i: [] for i in range(len(picks))}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(range(len(picks)))
            for i in order if r % 2 == 0 else order[::-1]:
                measured[i].append(_run(picks[i], hardware, args.steps, tmp))
                print(f"  round {r + 1}: {_name(picks[i])}: {measured[i][-1] * 1e3:.1f} ms",
                      flush=True)
    pred = [p.step_s for p in picks]
    meas = [statistics.median(measured[i]) for i in range(len(picks))]
    print("| planner rank | configuration | predicted ms | measured ms (median) |")
    print("|---|---|---|---|")
    for i, p in enumerate(picks):
        print(f"| {ranked.index(p) + 1} | {_name(p)} | {pred[i] * 1e3:.1f} | "
              f"{meas[i] * 1e3:.1f} |")
    best = min(range(len(picks)), key=meas.__getitem__)
    print(f"measured best: planner rank {ranked.index(picks[best]) + 1}; the planner's choice "
          f"measured {meas[0] / meas[best] - 1:+.1%} against it (within 5%: "
          f"{meas[0] <= 1.05 * meas[best]})")
    print(f"Spearman rank correlation, predicted vs measured: {_spearman(pred, meas):.2f}")


if __name__ == "__main__":
    main()
