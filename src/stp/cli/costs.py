"""`stp costs`: per-stage costs measured by `stp train --trace`.

    stp train --pp 2 --steps 20 --trace run.json
    stp costs run.json --out stages.json
    stp search --pp 2 -m 8 --stage-costs stages.json --memory-limit 4
    stp simulate --schedule zb-v --pp 2 -m 8 --costs-from run.json

Reads the trace (`stp.costmodel.measured`: per global stage, the mean F, B, W
compute and all-reduce time of one microbatch, the units of a pass, the send
latency) and prints it as a table, or with `--json` / `--out` as the
`--stage-costs` file format (`stp.sim.stages`), times in milliseconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stp.costmodel.measured import load_measured

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "costs", help="per-stage costs measured by `stp train --trace` (for --stage-costs)",
        description="Turn a measured trace into per-stage costs: the simulator's and the "
        "search's input for your own model and machine.",
    )
    p.add_argument("trace", metavar="TRACE.json", help="a trace `stp train --trace` wrote")
    p.add_argument("--out", metavar="FILE.json", default=None,
                   help="write the per-stage costs (the --stage-costs format)")
    p.add_argument("--json", action="store_true", help="print the per-stage costs as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    table = load_measured(args.trace)
    doc = {**table.to_json(), "source": f"measured: {Path(args.trace).name}"}
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"{args.trace}: {table.num_stages} global stages, times in ms per microbatch; "
          f"send latency {table.comm:.4g} ms")
    head = f"{'stage':>5} {'layers':>6} {'f':>9} {'b':>9} {'w':>9} {'ar':>8} {'ar_b':>8} units"
    print(head)
    print("-" * len(head))
    part = table.partition or (None,) * table.num_stages
    for s, (c, layers) in enumerate(zip(table.stages, part, strict=True)):
        shown = "-" if layers is None else str(layers)
        print(f"{s:>5} {shown:>6} {c.f:>9.4g} {c.b:>9.4g} {c.w:>9.4g} {c.ar:>8.3g} "
              f"{c.ar_backward:>8.3g} {c.units:>5}")
    if args.out:
        print(f"wrote {args.out}")
    return 0
