"""`stp draw`: picture (SVG or PNG) and Perfetto trace of a simulated timeline.

    stp draw --schedule stp --pp 4 -m 12 --cost f=2,b=2,w=2,ar=0.4 --out stp.svg
    stp draw --from-csv order.csv --out order.png --trace order.json
"""

from __future__ import annotations

import argparse
import sys

from stp.cli.common import add_cost_args, costs_from_args
from stp.cli.offload_opts import add_offload_args, offload_from_args
from stp.cli.source import add_source_args, load_schedule
from stp.schedule import validate
from stp.sim import simulate

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "draw",
        help="draw the simulated timeline (.svg/.png) and/or write a Perfetto trace",
        description="Simulate a schedule and draw it: one band per rank with compute, TP and "
        "send lanes and the activation memory over time. SVG needs nothing; PNG needs "
        "matplotlib (pip install 'stp[plot]').",
    )
    add_source_args(p)
    add_cost_args(p)
    add_offload_args(p)
    p.add_argument("--out", metavar="FILE.svg|FILE.png", default=None,
                   help="picture to write; the suffix picks the format")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="also write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    p.add_argument("--title", default=None, help="title of the picture")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.out and not args.trace:
        raise ValueError("nothing to write: give --out FILE.svg|FILE.png and/or --trace FILE.json")
    if args.out and not args.out.lower().endswith((".svg", ".png")):
        raise ValueError(f"--out {args.out!r}: the picture must end in .svg or .png")
    sch = load_schedule(args)
    if args.from_csv is None and args.from_json is None:
        validate(sch)  # files are validated as they are read
    costs, mem = costs_from_args(args)
    plan, oc = offload_from_args(args, sch, costs, mem)
    res = simulate(sch, costs, mem, layers=args.layers, offload=plan, offload_costs=oc)
    from stp import viz

    if args.out:
        viz.draw_timeline(res, args.out, title=args.title)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.trace:
        viz.write_trace(res, args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    return 0
