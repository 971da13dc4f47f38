"""Simulated activation offload: where it starts to cost time.

STP at p=4, m=16, f=b=w=2, ar=0.4 (the issue's setting), offload policies
over host-link bandwidths, next to PipeOffload's k = T_offload / T_compute
(arXiv 2503.01328); k <= 1 means every activation can go without a stall).
Bandwidth is in M_B per time unit (default --act-bytes 1).

    python3 benchmarks/bench_offload.py [--json]
"""

from __future__ import annotations

import argparse
import json

from stp.schedule import generate
from stp.sim import Costs, MemCosts, OffloadCosts, simulate
from stp.sim.offload import offload_ratio, plan_offload

COSTS = Costs(f=2, b=2, w=2, ar=0.4)
BANDWIDTHS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 1.0, 2.0)
POLICIES = ("stp", "selective:0.3", "all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sch = generate("stp", 4, 16)
    mem = MemCosts()
    base = simulate(sch, COSTS, mem, record_spans=False)
    rows = []
    for bw in BANDWIDTHS:
        oc = OffloadCosts(bandwidth=bw)
        row: dict[str, object] = {"bandwidth": bw, "k": offload_ratio(COSTS, mem, oc)}
        for pol in POLICIES:
            plan = plan_offload(sch, pol, COSTS, mem, oc)
            res = simulate(sch, COSTS, mem, offload=plan, offload_costs=oc, record_spans=False)
            row[pol] = {
                "peak": max(res.peak_activation),
                "peak_cut": 1 - max(res.peak_activation) / max(base.peak_activation),
                "slowdown": res.makespan / base.makespan - 1,
                "offloaded": len(plan),
            }
        rows.append(row)
    if args.json:
        print(json.dumps({"baseline": {"makespan": base.makespan,
                                        "peak": max(base.peak_activation)}, "rows": rows}))
        return
    print(f"stp p=4 m=16 f=b=w=2 ar=0.4: no offload makespan {base.makespan:g}, "
          f"peak {max(base.peak_activation):g} M_B")
    head = f"{'bandwidth':>9} {'k':>6} " + " ".join(f"{p + ' cut/slow':>24}" for p in POLICIES)
    print(head)
    print("-" * len(head))
    for row in rows:
        cells = []
        for pol in POLICIES:
            c = row[pol]
            cells.append(f"{c['peak_cut']:+.1%} / {c['slowdown']:+.2%}")  # type: ignore[index]
        print(f"{row['bandwidth']:>9g} {row['k']:>6.2f} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
