"""`stp simulate` and `stp compare`: simulated makespan, bubbles and memory."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from stp.cli.budget_opts import add_budget_arg, budget_from_args, check_budget
from stp.cli.common import (
    MAX_VALUE,
    add_cost_args,
    costs_from_args,
    int_in,
    microbatch_count,
    positive_float,
    pp_count,
    schedule_from_args,
)
from stp.cli.offload_opts import add_offload_args, offload_from_args
from stp.cli.source import add_source_args, load_schedule
from stp.cli.stage_opts import (
    add_stage_args,
    auto_json,
    check_table_work,
    describe,
    partition_text,
    stage_inputs,
)
from stp.schedule import validate
from stp.schedule.limits import MAX_MICROBATCHES, MAX_RANKS
from stp.schedule.registry import SCHEDULES, get
from stp.sim import SimResult, simulate
from stp.sim.costs import parse_kv
from stp.sim.inlayer import MAX_CHUNKS, InLayer
from stp.sim.stages import StageCosts


def add_overlap_args(p: argparse.ArgumentParser) -> None:
    """--braid, --tp-overlap, --tp-overlap-chunks, --tp-overlap-costs (stp.sim.inlayer)."""
    p.add_argument("--braid", choices=("on", "off"), default="on",
                   help="on (default): braided blocks braid their passes; off: pass by pass")
    p.add_argument("--tp-overlap", action="store_true",
                   help="in-layer TP overlap on the passes that run alone: each unit's "
                   "collectives and matmuls cut into K chunks (K=1: none cut, but W's "
                   "all-gather of its input, with sequence parallelism, charged)")
    p.add_argument("--tp-overlap-chunks", type=int_in(1, MAX_CHUNKS), default=None, metavar="K",
                   help=f"chunks per unit with --tp-overlap (default 4; 1..{MAX_CHUNKS})")
    p.add_argument("--tp-overlap-costs", default=None, metavar="launch=..,efficiency=..",
                   help="with --tp-overlap: what one more collective call costs (cost units) "
                   "and the matmul efficiency of a chunk relative to the whole (0..1]; "
                   "default: from --hardware with --model, else launch=0,efficiency=1")


def chunk_plans(args: argparse.Namespace) -> Callable[[int], InLayer]:
    """K -> how K chunks are priced: from --hardware with --model, else free."""
    if getattr(args, "model", None) is None:
        return InLayer
    from stp.cli.common import model_from_args
    from stp.costmodel import parse_hardware
    from stp.costmodel.inlayer import in_layer_plan

    spec: Any = model_from_args(args)  # a decoder's or a multimodal model's spec
    hardware = parse_hardware(args.hardware or "a100-80g")

    def plan_for(k: int) -> InLayer:
        return in_layer_plan(hardware, spec.tp, spec.sequence * spec.micro_batch, k)
    return plan_for


def overlap_from_args(args: argparse.Namespace) -> tuple[bool, InLayer | None]:
    """(braid, in-layer plan or None) from the options of `add_overlap_args`."""
    braid = args.braid == "on"
    if not args.tp_overlap:
        for flag, val in (("--tp-overlap-chunks", args.tp_overlap_chunks),
                          ("--tp-overlap-costs", args.tp_overlap_costs)):
            if val is not None:
                raise ValueError(f"{flag} needs --tp-overlap")
        return braid, None
    k = args.tp_overlap_chunks or 4
    base = chunk_plans(args)(k)
    kv = parse_kv(args.tp_overlap_costs or "", ("launch", "efficiency"), "--tp-overlap-costs")
    return braid, InLayer(k, kv.get("launch", base.launch), kv.get("efficiency", base.efficiency))


def _mode_text(res: SimResult) -> str:
    """`braided`, `both K=4`, ...: how TP collectives were overlapped."""
    return res.mode + (f" K={res.in_layer.chunks}" if res.in_layer else "")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate one schedule and print its timing and memory")
    add_source_args(p)
    add_cost_args(p)
    add_stage_args(p)
    add_offload_args(p)
    p.add_argument("--memory-limit", type=positive_float, default=None, metavar="X",
                   help="refuse the schedule if a rank's peak activation exceeds this "
                   f"(units of M_B; a number > 0 and <= {MAX_VALUE:g})")
    add_budget_arg(p)
    add_overlap_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_simulate)

    c = sub.add_parser("compare", help="simulate several schedules side by side")
    c.add_argument("--pp", type=pp_count, required=True,
                   help=f"pipeline ranks p (at most {MAX_RANKS})")
    c.add_argument("--microbatches", "-m", type=microbatch_count, required=True,
                   help=f"microbatches m (at most {MAX_MICROBATCHES})")
    c.add_argument("--schedules", default=None,
                   help="comma-separated names (default: every schedule that accepts p and m)")
    add_cost_args(c)
    add_stage_args(c)
    add_offload_args(c)
    add_overlap_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--plot", metavar="FILE.png|FILE.svg", default=None,
                   help="also draw makespan and peak memory per schedule")
    c.set_defaults(func=run_compare, chunks=None)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _unit(stages: StageCosts | None) -> str:
    """Times from a model, a stage-cost file or a trace are milliseconds; uniform
    `--cost` values are in whatever unit the user gave them."""
    return "ms" if stages is not None else "cost units"


def _layers_text(layers: int, stages: StageCosts | None) -> str:
    """`layers/chunk=N` for uniform costs; the partition's range for per-stage costs."""
    part = stages.partition if stages is not None else None
    if part:
        lo, hi = min(part), max(part)
        return f"layers/stage={lo}" if lo == hi else f"layers/stage={lo}-{hi}"
    return f"layers/chunk={layers}"


def run_simulate(args: argparse.Namespace) -> int:
    sch = load_schedule(args)
    budget_from_args(args)  # a bad size or a budget without --model, before any work
    costs, mem = costs_from_args(args)
    inputs = stage_inputs(args, costs, mem, sch.num_ranks, args.memory_limit)
    costs, mem = inputs.reported(costs, mem, sch.num_ranks)
    stages, auto = inputs.for_schedule(sch)
    check_table_work(stages, sch, "the stage cost table")
    # per-stage memory is judged by the simulated peak below
    order_limit = None if args.offload != "none" or stages is not None else args.memory_limit
    validate(sch, memory_limit=order_limit, mem=mem)
    plan, oc = offload_from_args(args, sch, costs, mem, stages)
    braid, in_layer = overlap_from_args(args)
    res = simulate(sch, costs, mem, layers=args.layers, offload=plan, offload_costs=oc,
                   record_spans=False, stages=stages, braid=braid, in_layer=in_layer)
    if args.memory_limit is not None and max(res.peak_activation) > args.memory_limit + 1e-9:
        worst = max(res.ranks, key=lambda r: r.peak_activation)
        raise ValueError(f"rank {worst.rank}: peak activation {worst.peak_activation:g} with "
                         f"offload {args.offload} exceeds the limit {args.memory_limit:g}")
    check_budget(args, res)
    if args.json:
        print(json.dumps({**res.to_json(), **auto_json(auto)}))
        return 0
    unit = _unit(stages)
    print(f"schedule {sch.name}: p={sch.num_ranks} m={sch.num_microbatches} "
          f"v={sch.chunks} {_layers_text(args.layers, stages)}  costs {_costs_text(res)}")
    if "torch_note" in sch.meta:  # where PyTorch refuses (p, m): how this one differs
        print(f"note: {sch.meta['torch_note']}")
    for line in describe(stages, auto):
        print(line)
    if in_layer is not None or not braid:
        print(f"tp overlap: {_mode_text(res)}" + (
            f" (chunk launch {in_layer.launch:.4g}, chunk matmul efficiency "
            f"{in_layer.efficiency:.3g})" if in_layer else ""))
    print(f"makespan {_fmt(res.makespan)} {unit}  bubble_rate {res.bubble_rate:.2%}  "
          f"pp_bubble {_fmt(res.pp_bubble)}  tp_bubble {_fmt(res.tp_bubble)}  "
          + (f"a2a_bubble {_fmt(res.a2a_bubble)}  " if res.costs.a2a else "")
          + f"(critical rank {res.critical_rank.rank})")
    header = ["rank", "span", "compute", "tp_total", "exposed_tp", "hidden_tp", "idle",
              "peak_act"]
    rows = [[str(r.rank), _fmt(r.span), _fmt(r.compute), _fmt(r.tp_total), _fmt(r.exposed_tp),
             _fmt(r.hidden_tp), _fmt(r.idle), _fmt(r.peak_activation)] for r in res.ranks]
    if any(r.a2a_total for r in res.ranks):  # expert parallelism's all-to-alls
        header[6:6] = ["a2a_total", "exposed_a2a", "hidden_a2a"]
        for row, r in zip(rows, res.ranks, strict=True):
            row[6:6] = [_fmt(r.a2a_total), _fmt(r.exposed_a2a), _fmt(r.hidden_a2a)]
    if plan is not None:
        base = simulate(sch, costs, mem, layers=args.layers, record_spans=False,
                        stages=stages, braid=braid, in_layer=in_layer)
        print(f"offload {plan.policy}: {len(plan)} activations; peak "
              f"{_fmt(max(base.peak_activation))} -> {_fmt(max(res.peak_activation))}, "
              f"makespan {_fmt(base.makespan)} -> {_fmt(res.makespan)} {unit}")
        header.append("offload_wait")
        for row, r in zip(rows, res.ranks, strict=True):
            row.append(_fmt(r.exposed_offload))
    print(_table(rows, header))
    print(f"times in {unit}; peak_act in units of one microbatch's activations (M_B)")
    return 0


def _costs_text(res: SimResult) -> str:
    c = res.costs
    sp = f" ag={c.ag:g} rs={c.rs:g}" if c.ag or c.rs else ""
    sp += f" a2a={c.a2a:g}" if c.a2a else ""
    return (f"f={c.f:g} b={c.b:g} w={c.w:g} ar={c.ar:g}{sp} comm={c.comm:g}; "
            f"mem b={res.mem.m_b:g} w={res.mem.m_w:g}")


def compare_results(args: argparse.Namespace) -> tuple[list[SimResult], list[str]]:
    """Simulate the requested schedules; returns results and skipped-name notes."""
    if args.schedules:
        names = [n.strip() for n in args.schedules.split(",") if n.strip()]
        for i, n in enumerate(names):
            get(n)  # unknown name -> ValueError listing choices
            if n in names[:i]:
                raise ValueError(f"--schedules names {n} twice; name each schedule once")
    else:
        names = list(SCHEDULES)
    costs, mem = costs_from_args(args)
    inputs = stage_inputs(args, costs, mem, args.pp)
    costs, mem = inputs.reported(costs, mem, args.pp)
    braid, in_layer = overlap_from_args(args)
    # with --tp-overlap every schedule twice: without it and with it, side by side
    modes = [(braid, None)] + ([(braid, in_layer)] if in_layer is not None else [])
    results, skipped = [], []
    for name in names:
        sch = schedule_from_args(args, name)
        validate(sch)
        try:
            stages, _ = inputs.for_schedule(sch)
        except ValueError:
            if not args.schedules:  # a partition or table of another stage count
                skipped.append(f"{name} ({sch.num_stages} stages)")
                continue
            raise
        check_table_work(stages, sch, "the stage cost table")
        plan, oc = offload_from_args(args, sch, costs, mem, stages)
        for br, il in modes:
            results.append(simulate(sch, costs, mem, layers=args.layers, offload=plan,
                                    offload_costs=oc, record_spans=bool(args.plot),
                                    stages=stages, braid=br, in_layer=il))
    if not results:
        raise ValueError("no schedule accepts these settings: " + ", ".join(skipped))
    results.sort(key=lambda r: (r.makespan, r.schedule.name))
    return results, skipped


def _without_offload(res: SimResult) -> SimResult:
    return simulate(res.schedule, res.costs, res.mem, layers=res.layers, record_spans=False,
                    stages=res.stages, braid=res.mode in ("braided", "both"),
                    in_layer=res.in_layer)


BASELINES = ("1f1b-interleaved", "zb-v")
"""The schedules the STP paper measures its gain against (the best of them)."""


def stp_gain(results: list[SimResult]) -> float | None:
    """STP's throughput gain over the fastest of `BASELINES`, as a fraction
    (best baseline makespan / STP makespan - 1); None if STP or every baseline
    is missing."""
    spans = {r.schedule.name: r.makespan for r in results if r.in_layer is None}
    base = [spans[n] for n in BASELINES if n in spans]
    if "stp" not in spans or not base:
        return None
    return min(base) / spans["stp"] - 1


def run_compare(args: argparse.Namespace) -> int:
    results, skipped = compare_results(args)
    slowest = max(r.makespan for r in results)
    offload = args.offload != "none"
    # with --offload, each row also shows the same schedule without it
    base = {id(r): _without_offload(r) for r in results} if offload else {}
    if args.json:
        rows = []
        for r in results:
            row = dict(r.to_json(), speedup=slowest / r.makespan)
            if offload:
                b = base[id(r)]
                row["without_offload"] = {"makespan": b.makespan,
                                          "peak_activation": b.peak_activation}
            rows.append(row)
        print(json.dumps({
            "pp": args.pp,
            "microbatches": args.microbatches,
            "offload": args.offload,
            "rows": rows,
            "skipped": skipped,
            "stp_gain_over_best_baseline": stp_gain(results),
        }))
    else:
        stages0 = results[0].stages
        layers = (f"layers/chunk={args.layers}" if stages0 is None
                  else "layers per stage: the partition column")
        print(f"p={args.pp} m={args.microbatches} {layers}  times in {_unit(stages0)}  "
              f"costs {_costs_text(results[0])}"
              + (f"  offload {args.offload}" if offload else ""))
        header = ["schedule", "tp_overlap", "makespan", "speedup", "bubble", "pp_bubble",
                  "tp_bubble", "peak_act"]
        rows = [[r.schedule.name, _mode_text(r), _fmt(r.makespan), f"{slowest / r.makespan:.3f}x",
                 f"{r.bubble_rate:.1%}", _fmt(r.pp_bubble), _fmt(r.tp_bubble),
                 _fmt(max(r.peak_activation))] for r in results]
        if results[0].costs.a2a:  # expert parallelism: the exposed all-to-all beside TP's
            header.insert(7, "a2a_bubble")
            for row, r in zip(rows, results, strict=True):
                row.insert(7, _fmt(r.a2a_bubble))
        if any(r.stages is not None and r.stages.partition for r in results):
            header.append("partition")
            for row, r in zip(rows, results, strict=True):
                row.append(partition_text(r.stages.partition if r.stages else None))
        if offload:
            header += ["makespan_no_off", "peak_no_off"]
            for row, r in zip(rows, results, strict=True):
                b = base[id(r)]
                row += [_fmt(b.makespan), _fmt(max(b.peak_activation))]
        print(_table(rows, header))
        gain = stp_gain(results)
        if gain is not None:
            print(f"stp vs the best of {' and '.join(BASELINES)}: {gain:+.1%} throughput")
        if skipped:
            print("skipped: " + ", ".join(skipped), file=sys.stderr)
    if args.plot:
        from stp.viz import plot_compare

        plot_compare(results, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0
