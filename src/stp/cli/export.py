"""`stp export`: write a schedule as PyTorch's compute-only CSV or as stp JSON.

    stp export --schedule stp --pp 4 -m 12 --format torch-csv --out stp.csv

The CSV loads into `torch.distributed.pipelining` (`_PipelineScheduleRuntime.
_load_csv`), which validates it and inserts sends and receives itself; the
JSON is our IR, to edit by hand and run with `stp simulate --from-json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stp.cli.common import add_schedule_args, schedule_from_args
from stp.schedule import validate
from stp.schedule.io import dump_csv, dump_json

__all__ = ["register", "run", "FORMATS"]

FORMATS = {"torch-csv": dump_csv, "json": dump_json}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a schedule as PyTorch's compute-only CSV or as stp JSON",
        description="Write a generated schedule to a file (or stdout): 'torch-csv' is "
        "torch.distributed.pipelining's compute-only CSV (one row per rank: F, I, W, B, "
        "(a;b)OVERLAP_F_B, global stages); 'json' is stp's own IR.",
    )
    add_schedule_args(p)
    p.add_argument(
        "--format", required=True, choices=sorted(FORMATS),
        help="torch-csv (PyTorch compute-only CSV) or json (stp IR, hand-editable)",
    )
    p.add_argument("--out", metavar="FILE", default=None, help="output file (default stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sch = schedule_from_args(args)
    validate(sch)  # nothing invalid leaves stp
    text = FORMATS[args.format](sch)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    print(f"wrote {args.out} ({sch.name}, p={sch.num_ranks}, m={sch.num_microbatches})",
          file=sys.stderr)
    return 0
