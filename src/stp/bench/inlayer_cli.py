"""`stp bench fidelity --sequence-parallel [--tp-overlap-chunks K]`: the checks of
its flags, the run (stp.bench.fidelity_inlayer) and its report
(stp.bench.inlayer_report), for stp.cli.bench."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from stp.bench.fidelity_inlayer import InLayerSettings
from stp.bench.inlayer_report import format_report, predict_rows
from stp.models.emulated import UnitTimes
from stp.schedule.registry import make as make_schedule

__all__ = ["run_inlayer_fidelity", "check_flags"]


def check_flags(args: argparse.Namespace) -> None:
    """ValueError (one line) naming a flag the sequence-parallel mode cannot take."""
    k = args.tp_overlap_chunks
    if k and not args.sequence_parallel:
        raise ValueError(f"--tp-overlap-chunks {k} cuts sequence parallelism's collectives: "
                         "add --sequence-parallel")
    if args.seq_len % 2:
        raise ValueError(f"--sequence-parallel splits the sequence over tp=2: --seq-len "
                         f"{args.seq_len} is not even (stp refuses rather than pads)")
    if k and (args.seq_len // 2) % k:
        raise ValueError(f"--tp-overlap-chunks {k}: each TP rank's rows (--seq-len "
                         f"{args.seq_len} / 2) must divide into {k} chunks")
    if args.trace_dir:
        raise ValueError("--trace-dir is not available with --sequence-parallel (the "
                         "configurations alternate; trace one with stp train --trace)")


def run_inlayer_fidelity(args: argparse.Namespace, names: tuple[str, ...], unit: UnitTimes,
                         launch: Callable[[InLayerSettings], dict[str, Any]]) -> int:
    """Each schedule of `names` without and with K chunks; prints the table (and
    the JSON line with --json). `launch` runs the 4 workers."""
    check_flags(args)
    for n in names:
        make_schedule(n, 2, args.microbatches)  # refuse before starting workers
    chunks = (0, args.tp_overlap_chunks) if args.tp_overlap_chunks else (0,)
    s = InLayerSettings(configs=tuple((n, k) for n in names for k in chunks),
                        microbatches=args.microbatches, layers=args.layers, hidden=args.hidden,
                        seq_len=args.seq_len, microbatch_size=args.microbatch_size, unit=unit,
                        rounds=args.rounds, braid=args.braid == "on")
    res = launch(s)
    rows = predict_rows(res, unit, layers=s.layers, microbatches=s.microbatches, braid=s.braid)
    print(format_report(res, rows, unit, layers=s.layers, microbatches=s.microbatches,
                        shape=(s.microbatch_size, s.seq_len, s.hidden), braid=s.braid))
    if args.json:
        figures = {k: v for k, v in res.items() if k != "rows"}
        print(json.dumps({"rows": rows, **figures, "unit_s": [unit.f, unit.b, unit.w],
                          "rounds": s.rounds}))
    return 0
