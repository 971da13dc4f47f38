"""Where a subcommand's schedule comes from: a generator name, a file, or text.

`--from-csv FILE` and `--from-json FILE` always name a file, whatever the name
holds (`run,v2.csv` is a file name); `--schedule-text TEXT` is a schedule
written out on the command line. The readers bound the file's size and its
indices (`stp.schedule.io`); the schedule read obeys the same work limits as
a generated one (`stp.cli.common.check_work`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stp.cli.common import add_size_args, check_work, schedule_from_args
from stp.schedule import Schedule

__all__ = ["add_source_args", "load_schedule"]

_FILE_FLAGS = ("--from-csv", "--from-json", "--schedule-text")


def add_source_args(p: argparse.ArgumentParser) -> None:
    """--schedule/--pp/-m/--chunks, or --from-csv/--from-json/--schedule-text."""
    p.add_argument("--schedule", help="schedule name (see `stp schedules`)")
    add_size_args(p, required=False)
    p.add_argument("--from-csv", metavar="FILE",
                   help="read a PyTorch compute-only CSV schedule file instead of a named one")
    p.add_argument("--from-json", metavar="FILE", help="read a schedule file saved as stp JSON")
    p.add_argument("--schedule-text", metavar="TEXT",
                   help="the schedule itself: compute-only CSV (one line per rank, e.g. "
                   "$'0F0,0B0\\n1F0,1B0'), or stp JSON when it starts with '{'")


def load_schedule(args: argparse.Namespace) -> Schedule:
    """The schedule named by --schedule/--pp/-m, or read from --from-csv,
    --from-json or --schedule-text."""
    given = [f for f in _FILE_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}, not several")
    if given:
        if args.schedule or args.chunks:
            raise ValueError("--schedule/--chunks name a generated schedule; "
                             f"{given[0]} brings its own")
        sch, where = _read(args, given[0])
        if args.microbatches is not None and args.microbatches != sch.num_microbatches:
            raise ValueError(f"--microbatches {args.microbatches} but {where} has "
                             f"{sch.num_microbatches}")
        check_work(sch.num_stages, sch.num_microbatches, getattr(args, "layers", 1),
                   f"the schedule of {where}")
        return sch
    missing = [o for o, v in (("--schedule", args.schedule), ("--pp", args.pp),
                              ("--microbatches", args.microbatches)) if v is None]
    if missing:
        raise ValueError(
            f"{args.command} needs {', '.join(missing)} (or --from-csv FILE / --from-json FILE"
            " / --schedule-text TEXT)"
        )
    return schedule_from_args(args)


def _read(args: argparse.Namespace, flag: str) -> tuple[Schedule, str]:
    """(the schedule, how messages name where it came from)."""
    from stp.schedule import io

    if flag == "--from-csv":
        path = Path(args.from_csv)
        return io.load_csv(path, num_microbatches=args.microbatches), f"--from-csv {path}"
    if flag == "--from-json":
        return io.load_json(Path(args.from_json)), f"--from-json {args.from_json}"
    text = args.schedule_text
    if text.removeprefix("\ufeff").lstrip().startswith("{"):
        return io.parse_json(text), "--schedule-text"
    return io.parse_csv(text, num_microbatches=args.microbatches, name="text"), "--schedule-text"
