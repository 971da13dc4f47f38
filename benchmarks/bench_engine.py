"""How long generate + validate + simulate takes (target: stp at p=32, m=256 under 1 s).

    python3 benchmarks/bench_engine.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from stp.schedule import generate, validate
from stp.sim import Costs, simulate


def measure(name: str, p: int, m: int, repeat: int = 3) -> dict[str, float]:
    best = {"generate": float("inf"), "validate": float("inf"), "simulate": float("inf")}
    for _ in range(repeat):
        t0 = time.perf_counter()
        sch = generate(name, p, m)
        t1 = time.perf_counter()
        validate(sch)
        t2 = time.perf_counter()
        simulate(sch, Costs(f=2, b=2, w=2, ar=0.4, comm=0.1), record_spans=False)
        t3 = time.perf_counter()
        for k, dt in zip(best, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            best[k] = min(best[k], dt)
    best["total"] = best["generate"] + best["validate"] + best["simulate"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for m in (64, 128, 256, 512):
        t = measure("stp", 32, m)
        rows.append({"schedule": "stp", "pp": 32, "microbatches": m, **t})
    t = measure("stp", 32, 256)
    t_spans = time.perf_counter()
    simulate(generate("stp", 32, 256), Costs(f=2, b=2, w=2, ar=0.4))
    t_spans = time.perf_counter() - t_spans
    if args.json:
        print(json.dumps({"rows": rows, "simulate_with_spans_s": t_spans}))
        return
    print(f"{'schedule':>8} {'p':>3} {'m':>4} {'generate':>9} {'validate':>9} "
          f"{'simulate':>9} {'total':>8}")
    for r in rows:
        print(f"{r['schedule']:>8} {r['pp']:>3} {r['microbatches']:>4} {r['generate']:9.3f} "
              f"{r['validate']:9.3f} {r['simulate']:9.3f} {r['total']:8.3f}")
    print(f"target: p=32 m=256 total < 1 s: {'met' if t['total'] < 1 else 'NOT met'} "
          f"({t['total']:.3f} s); with timeline spans recorded: simulate {t_spans:.3f} s")


if __name__ == "__main__":
    main()
