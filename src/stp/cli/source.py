"""Where a subcommand's schedule comes from: a generator name, or a file."""

from __future__ import annotations

import argparse

from stp.cli.common import positive_int, schedule_from_args
from stp.schedule import Schedule

__all__ = ["add_source_args", "load_schedule"]


def add_source_args(p: argparse.ArgumentParser) -> None:
    """--schedule/--pp/-m/--chunks, or --from-csv/--from-json."""
    p.add_argument("--schedule", help="schedule name (see `stp schedules`)")
    p.add_argument("--pp", type=positive_int, help="pipeline ranks p")
    p.add_argument("--microbatches", "-m", type=positive_int, help="microbatches m")
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="chunks per rank for 1f1b-interleaved (default 2)")
    p.add_argument("--from-csv", metavar="FILE",
                   help="use a PyTorch compute-only CSV schedule instead of a named one")
    p.add_argument("--from-json", metavar="FILE", help="use a schedule saved as stp JSON")


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
        raise ValueError(
            f"{args.command} needs {', '.join(missing)} (or --from-csv FILE / --from-json FILE)"
        )
    return schedule_from_args(args)


