"""`stp search`: the fastest schedule whose every rank fits a memory limit.

    stp search --pp 8 -m 24 --cost f=18.5,b=18.1,w=9.3,comm=0.6 --mem w=0.37 \\
        --memory-limit 16
    stp search --pp 2 -m 16 --model qwen2-12.1b,sequence=6144 --hardware a800-80g \\
        --memory-limit 4 --out found.json

Prints the found schedule's timing next to every handcrafted schedule under the
same costs and limit; `--json` gives the `stp simulate --json` fields of the
found schedule plus `search_seconds` (and the baselines). `--out` writes the
schedule as stp JSON (`FILE.json`) or PyTorch's compute-only CSV (`FILE.csv`),
which `stp simulate --from-json/--from-csv`, `stp draw` and the runtime read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stp.cli.budget_opts import add_budget_arg, budget_from_args, check_budget, limit_from_budget
from stp.cli.common import (
    MAX_CHUNKS,
    MAX_VALUE,
    add_cost_args,
    check_work,
    chunk_count,
    costs_from_args,
    int_in,
    microbatch_count,
    number_in,
    positive_float,
    pp_count,
)
from stp.cli.stage_opts import StageInputs, add_stage_args, describe, stage_inputs
from stp.schedule.limits import MAX_MICROBATCHES, MAX_RANKS
from stp.search import OBJECTIVES, SearchResult, search

__all__ = ["register", "run"]

MAX_TIME_LIMIT = 86400.0
"""Longest --time-limit: a day."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="find the fastest schedule within a memory limit (braided or not)",
        description="Search per-rank orders that minimise the simulated step time with every "
        "rank's peak activation within --memory-limit (units of M_B, as `stp simulate` "
        "reports). Seeds: the handcrafted schedules; construction: a greedy list scheduler "
        "after the Zero Bubble heuristic; improvement: per-rank in-flight caps and, with TP "
        "all-reduce (ar > 0), STP braided blocks.",
    )
    p.add_argument("--pp", type=pp_count, required=True,
                   help=f"pipeline ranks p (at most {MAX_RANKS})")
    p.add_argument("--microbatches", "-m", type=microbatch_count, required=True,
                   help=f"microbatches m (at most {MAX_MICROBATCHES})")
    add_cost_args(p, recompute_auto=True)
    add_stage_args(p)
    p.add_argument("--memory-limit", type=positive_float, default=None, metavar="X",
                   help="most activation memory any rank may hold, units of M_B (a number "
                   f"> 0 and <= {MAX_VALUE:g}); required unless --memory-budget gives it")
    add_budget_arg(p)
    p.add_argument("--placement", choices=("looped", "v", "auto"), default="auto",
                   help="looped (--chunks per rank, default 1), v (two chunks in a V) or "
                   "auto (both, and any handcrafted schedule as a seed; default)")
    p.add_argument("--chunks", type=chunk_count, default=1,
                   help=f"chunks per rank of the looped placement (default 1, at most "
                   f"{MAX_CHUNKS})")
    p.add_argument("--braided", choices=("auto", "on", "off"), default="auto",
                   help="allow STP braided blocks: auto = when the all-reduce cost ar > 0")
    p.add_argument("--objective", choices=OBJECTIVES, default="makespan",
                   help="makespan (default) or span: the longest rank span, the Zero "
                   "Bubble paper's cost, which orders schedules by bubble rate")
    p.add_argument("--time-limit", type=number_in(0.0, MAX_TIME_LIMIT), default=20.0,
                   metavar="S", help="stop improving after S seconds (default 20, at most "
                   f"{MAX_TIME_LIMIT:g}); the handcrafted baselines are simulated first")
    p.add_argument("--max-evaluations", type=int_in(1, 10**9), default=None, metavar="N",
                   help="also stop after scoring about N candidate schedules: the same "
                   "result on any machine (default: no budget, only --time-limit)")
    p.add_argument("--out", metavar="FILE.json|FILE.csv", default=None,
                   help="write the schedule: .json (stp IR) or .csv (PyTorch compute-only)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="also price the found schedule in every TP overlap mode (none, "
                   "braided, in-layer, both at K = 2, 4, 8 chunks: stp.search.overlap) and "
                   "name the fastest; chunks priced from --hardware with --model, else free")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: simulate's fields plus search_seconds")
    p.set_defaults(func=run)


def _overlap_modes(args: argparse.Namespace, res: SearchResult) -> list:
    """The found schedule in every TP overlap mode (`--tp-overlap`), fastest first."""
    from stp.cli.simulate import chunk_plans
    from stp.search.overlap import modes

    r = res.result
    got = modes(res.schedule, r.costs, r.mem, r.layers, stages=r.stages,
                plan_for=chunk_plans(args))
    return sorted(got, key=lambda x: x.makespan)


def _write(res: SearchResult, path: str) -> None:
    from stp.schedule.io import dump_csv, dump_json

    suffix = Path(path).suffix.lower()
    writers = {".json": dump_json, ".csv": dump_csv}
    if suffix not in writers:
        raise ValueError(f"--out {path!r}: the file name must end in .json or .csv")
    try:
        Path(path).write_text(writers[suffix](res.schedule), encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write {path!r}: {e}") from None


def _table(res: SearchResult) -> str:
    found = res.result
    rows = [("search", found.makespan, found.bubble_rate, max(found.peak_activation), "")]
    for b in res.baselines:
        if b.result is None:
            rows.append((b.name, None, None, None, b.note))
        else:
            rows.append((b.name, b.result.makespan, b.result.bubble_rate,
                         max(b.result.peak_activation), b.note))
    head = f"{'schedule':<18} {'makespan':>10} {'vs search':>9} {'bubble':>7} {'peak':>7}  note"
    lines = [head, "-" * len(head)]
    for name, mk, br, peak, note in rows:
        if mk is None:
            lines.append(f"{name:<18} {'-':>10} {'-':>9} {'-':>7} {'-':>7}  {note}")
            continue
        lines.append(f"{name:<18} {mk:>10.4g} {mk / found.makespan:>8.3f}x {br:>7.2%} "
                     f"{peak:>7.4g}  {note}")
    return "\n".join(lines)


def _placement(args: argparse.Namespace, inputs: StageInputs) -> tuple[str, int]:
    """(--placement, --chunks) fitted to a per-stage table or explicit partition
    of a fixed stage count: p stages are one chunk per rank, 2p also a V."""
    if inputs.table is not None:
        n, what = inputs.table.num_stages, inputs.where
    elif isinstance(inputs.partition, tuple):
        n, what = len(inputs.partition), "--partition"
    else:
        return args.placement, args.chunks
    p = args.pp
    if n % p or not 1 <= n // p <= MAX_CHUNKS:
        raise ValueError(f"{what} has {n} stages; with --pp {p} give {p} (one chunk per rank) "
                         f"or {2 * p} (two chunks: looped or V) or another multiple of {p}")
    chunks = n // p
    if args.placement == "v" and chunks != 2:
        raise ValueError(f"{what} has {n} stages; the V placement of --pp {p} has {2 * p}")
    if chunks != 2:
        return "looped", chunks
    return args.placement, chunks


def run(args: argparse.Namespace) -> int:
    # the V placement has two chunks per rank, the looped one --chunks
    check_work(args.pp * max(2, args.chunks), args.microbatches, args.layers,
               f"--pp {args.pp} -m {args.microbatches}")
    budget = budget_from_args(args)
    if args.memory_limit is None:
        if budget is None:
            raise ValueError("give --memory-limit X (units of M_B) or --memory-budget SIZE "
                             "(bytes, with --model)")
        args.memory_limit = limit_from_budget(args, budget)
    costs, mem = costs_from_args(args)
    choice = None
    if args.recompute == "auto":
        res, choice, costs, mem = _search_recompute(args)
        stages_auto = None
    else:
        inputs = stage_inputs(args, costs, mem, args.pp, args.memory_limit)
        placement, chunks = _placement(args, inputs)
        costs, mem = inputs.reported(costs, mem, args.pp)  # the constructions' guide
        res = search(
            args.pp, args.microbatches, costs, mem,
            memory_limit=args.memory_limit, placement_kind=placement,
            braided=args.braided, chunks=chunks, objective=args.objective,
            time_limit=args.time_limit, layers=args.layers,
            max_evaluations=args.max_evaluations,
            stage_costs=None if inputs.uniform else inputs.for_stages,
        )
        stages_auto = None
        if inputs.partition == "auto":  # the found order, its partition judged by the simulator
            _, stages_auto = inputs.for_schedule(res.schedule)
            res.result = stages_auto.result if stages_auto else res.result
    check_budget(args, res.result)
    if args.out:
        _write(res, args.out)
    overlap = _overlap_modes(args, res) if args.tp_overlap else []
    if args.json:
        extra = {"tp_overlap_modes": [
            {"tp_overlap": r.mode, "tp_overlap_chunks": r.in_layer.chunks if r.in_layer else 0,
             "makespan": r.makespan} for r in overlap]} if overlap else {}
        print(json.dumps({**res.to_json(), **(choice.to_json() if choice else {}), **extra}))
        return 0
    c = costs
    sp = f" ag={c.ag:g} rs={c.rs:g}" if c.ag or c.rs else ""
    print(f"search p={args.pp} m={args.microbatches} limit {args.memory_limit:g} M_B  costs "
          f"f={c.f:g} b={c.b:g} w={c.w:g} ar={c.ar:g}{sp} comm={c.comm:g}; mem b={mem.m_b:g} "
          f"w={mem.m_w:g}")
    print(f"found in {res.seconds:.2f} s ({res.evaluated} candidates): {res.origin}")
    if choice is not None:
        tried = ", ".join(f"{k} {'-' if v is None else f'{v:.4g}'}"
                          for k, v in choice.tried.items())
        print(f"recompute per stage: {','.join(choice.modes)} (every stage in one mode: {tried})")
    for line in describe(res.result.stages, stages_auto):
        print(line)
    print(_table(res))
    if overlap:
        best = overlap[0]
        print("tp overlap of the found schedule: " + ", ".join(
            f"{r.mode}{f' K={r.in_layer.chunks}' if r.in_layer else ''} {r.makespan:.4g}"
            for r in overlap) + f" (fastest: {best.mode}"
            + (f" K={best.in_layer.chunks})" if best.in_layer else ")"))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _search_recompute(args: argparse.Namespace) -> tuple:
    """`--recompute auto`: stp.search.recompute over the modes, memory in M_B
    without recomputation."""
    from stp.cli.common import model_from_args
    from stp.costmodel import parse_hardware
    from stp.costmodel.decoder.spec import decoder_only
    from stp.search.recompute import search_recompute

    if args.model is None:
        raise ValueError("--recompute auto needs --model (a decoder preset or fields)")
    spec = model_from_args(args)
    spec = decoder_only(spec, "--recompute auto")
    for flag, val in (("--partition", args.partition), ("--cost", args.cost),
                      ("--mem", args.mem)):
        if val is not None:
            raise ValueError(f"--recompute auto prices every mode from --model; drop {flag}")
    choice = search_recompute(
        spec, parse_hardware(args.hardware or "a100-80g"), args.pp, args.microbatches,
        memory_limit=args.memory_limit, time_limit=args.time_limit, layers=args.layers,
        placement_kind=args.placement, braided=args.braided, chunks=args.chunks,
        objective=args.objective)
    res = choice.result
    return res, choice, res.result.costs, res.result.mem
