"""`stp draw`: picture (SVG or PNG) and Perfetto trace of a simulated timeline.

    stp draw --schedule stp --pp 4 -m 12 --cost f=2,b=2,w=2,ar=0.4 --out stp.svg
    stp draw --schedule zb-v --pp 4 -m 8 --cost ag=0.2,rs=0.2 --tp-overlap --out zbv.svg
    stp draw --from-csv order.csv --out order.png --trace order.json
    stp draw --measured run.json --out run.svg    # what `stp train --trace` recorded
    stp draw --metrics runs/a runs/b --out curve.svg  # training curves from metrics.jsonl
"""

from __future__ import annotations

import argparse
import sys

from stp.cli.common import add_cost_args, costs_from_args
from stp.cli.offload_opts import add_offload_args, offload_from_args
from stp.cli.simulate import add_overlap_args, overlap_from_args
from stp.cli.source import add_source_args, load_schedule
from stp.cli.stage_opts import add_stage_args, check_table_work, describe, stage_inputs
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
    add_stage_args(p)
    add_offload_args(p)
    add_overlap_args(p)
    p.add_argument("--out", metavar="FILE.svg|FILE.png", default=None,
                   help="picture to write; the suffix picks the format")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="also write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    p.add_argument("--measured", metavar="TRACE.json", default=None,
                   help="draw a measured trace (`stp train --trace`) instead of a simulation: "
                   "every unit, TP collective (AR; RS and AG with --sequence-parallel) and "
                   "send of every rank, as run")
    p.add_argument("--metrics", metavar="RUN_DIR", nargs="+", default=None,
                   help="draw training curves instead of a schedule: loss (held-out dashed), "
                   "learning rate, gradient norm and tokens/s against the step, from each run "
                   "directory's metrics.jsonl (`stp train` writes it), the runs overlaid")
    p.add_argument("--title", default=None, help="title of the picture")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.metrics is not None:
        return _draw_curves(args)
    if args.measured is not None:
        return _draw_measured(args)
    if not args.out and not args.trace:
        raise ValueError("nothing to write: give --out FILE.svg|FILE.png and/or --trace FILE.json")
    if args.out and not args.out.lower().endswith((".svg", ".png")):
        raise ValueError(f"--out {args.out!r}: the picture must end in .svg or .png")
    sch = load_schedule(args)
    if (args.from_csv, args.from_json, args.schedule_text) == (None, None, None):
        validate(sch)  # files and text are validated as they are read
    costs, mem = costs_from_args(args)
    inputs = stage_inputs(args, costs, mem, sch.num_ranks)
    costs, mem = inputs.reported(costs, mem, sch.num_ranks)
    stages, auto = inputs.for_schedule(sch)
    check_table_work(stages, sch, "the stage cost table")
    plan, oc = offload_from_args(args, sch, costs, mem, stages)
    braid, in_layer = overlap_from_args(args)
    res = simulate(sch, costs, mem, layers=args.layers, offload=plan, offload_costs=oc,
                   stages=stages, braid=braid, in_layer=in_layer)
    for line in describe(stages, auto):
        print(line, file=sys.stderr)
    from stp import viz

    if args.out:
        viz.draw_timeline(res, args.out, title=args.title)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.trace:
        viz.write_trace(res, args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)
    return 0


def _refuse_schedule(args: argparse.Namespace, what: str) -> None:
    """`what` draws a recorded run: a schedule to simulate is refused."""
    given = [f for f in ("schedule", "from_csv", "from_json", "schedule_text")
             if getattr(args, f) is not None]
    if given:
        raise ValueError(f"{what} draws a recorded run; drop --{given[0].replace('_', '-')}"
                         " (a schedule to simulate)")


def _draw_curves(args: argparse.Namespace) -> int:
    """`--metrics RUN_DIR... --out FILE`: the runs' training curves."""
    _refuse_schedule(args, "--metrics")
    if args.trace or args.measured:
        raise ValueError(f"--metrics draws training curves; drop "
                         f"{'--trace' if args.trace else '--measured'}")
    if not args.out or not args.out.lower().endswith((".svg", ".png")):
        raise ValueError("--metrics needs --out FILE.svg or FILE.png")
    from stp import viz

    viz.draw_curves(args.metrics, args.out, title=args.title)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _draw_measured(args: argparse.Namespace) -> int:
    """`--measured TRACE.json --out FILE`: the trace as the runtime recorded it."""
    _refuse_schedule(args, "--measured")
    if args.trace:
        raise ValueError("--measured TRACE.json is a trace already (open it in "
                         "ui.perfetto.dev); drop --trace")
    if not args.out or not args.out.lower().endswith((".svg", ".png")):
        raise ValueError("--measured needs --out FILE.svg or FILE.png")
    from stp import viz

    viz.draw_measured(viz.load_measured_trace(args.measured), args.out, title=args.title)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
