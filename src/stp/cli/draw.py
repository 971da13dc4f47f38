"""`stp draw`: picture (SVG or PNG) and Perfetto trace of a simulated timeline.

    stp draw --schedule stp --pp 4 -m 12 --cost f=2,b=2,w=2,ar=0.4 --out stp.svg
    stp draw --from-csv order.csv --out order.png --trace order.json
"""

from __future__ import annotations

import argparse
import sys

from stp.cli.common import add_cost_args, costs_from_args, positive_int, schedule_from_args
from stp.schedule import Schedule, validate
from stp.sim import simulate

__all__ = ["register", "run", "load_schedule"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "draw",
        help="draw the simulated timeline (.svg/.png) and/or write a Perfetto trace",
        description="Simulate a schedule and draw it: one band per rank with compute, TP and "
        "send lanes and the activation memory over time. SVG needs nothing; PNG needs "
        "matplotlib (pip install 'stp[plot]').",
    )
    p.add_argument("--schedule", help="schedule name (see `stp schedules`)")
    p.add_argument("--pp", type=positive_int, help="pipeline ranks p")
    p.add_argument("--microbatches", "-m", type=positive_int, help="microbatches m")
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="chunks per rank for 1f1b-interleaved (default 2)")
    p.add_argument("--from-csv", metavar="FILE",
                   help="draw a PyTorch compute-only CSV schedule instead of a named one")
    p.add_argument("--from-json", metavar="FILE", help="draw a schedule saved as stp JSON")
    add_cost_args(p)
    p.add_argument("--out", metavar="FILE.svg|FILE.png", default=None,
                   help="picture to write; the suffix picks the format")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="also write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    p.add_argument("--title", default=None, help="title of the picture")
    p.set_defaults(func=run)


def load_schedule(args: argparse.Namespace) -> Schedule:
    """The schedule named by --schedule/--pp/-m, or read from --from-csv / --from-json."""
    if args.from_csv and args.from_json:
        raise ValueError("give --from-csv or --from-json, not both")
    if args.from_csv or args.from_json:
        if args.schedule or args.chunks:
            raise ValueError("--schedule/--chunks name a generated schedule; a file brings its own")
        from stp.schedule import io

        if args.from_csv:
            return io.load_csv(args.from_csv, num_microbatches=args.microbatches)
        sch = io.load_json(args.from_json)
        if args.microbatches is not None and args.microbatches != sch.num_microbatches:
            raise ValueError(f"--microbatches {args.microbatches} but {args.from_json} has "
                             f"{sch.num_microbatches}")
        return sch
    missing = [o for o, v in (("--schedule", args.schedule), ("--pp", args.pp),
                              ("--microbatches", args.microbatches)) if v is None]
    if missing:
        raise ValueError(f"draw needs {', '.join(missing)} (or --from-csv FILE / --from-json FILE)")
    return schedule_from_args(args)


def run(args: argparse.Namespace) -> int:
    if not args.out and not args.trace:
        raise ValueError("nothing to write: give --out FILE.svg|FILE.png and/or --trace FILE.json")
    if args.out and not args.out.lower().endswith((".svg", ".png")):
        raise ValueError(f"--out {args.out!r}: the picture must end in .svg or .png")
    sch = load_schedule(args)
    if args.from_csv is None and args.from_json is None:
        validate(sch)  # files are validated as they are read
    costs, mem = costs_from_args(args)
    res = simulate(sch, costs, mem, layers=args.layers)
    from stp import viz

    if args.out:
        viz.draw_timeline(res, args.out, title=args.title)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.trace:
        viz.write_trace(res, args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    return 0
