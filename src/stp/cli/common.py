"""Options shared by the schedule/simulator subcommands (simulate, compare, draw, ...)."""

from __future__ import annotations

import argparse

from stp.schedule import Schedule, generate
from stp.sim.costs import Costs, MemCosts, parse_costs, parse_mem

__all__ = ["add_schedule_args", "add_cost_args", "schedule_from_args", "costs_from_args"]


def positive_int(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"{val} must be >= 1")
    return val


def positive_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not val > 0 or val == float("inf"):
        raise argparse.ArgumentTypeError(f"{val:g} must be a finite number > 0")
    return val


def add_schedule_args(p: argparse.ArgumentParser, *, schedule_required: bool = True) -> None:
    p.add_argument(
        "--schedule", required=schedule_required, help="schedule name (see `stp schedules`)"
    )
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline ranks p")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True, help="microbatches m")
    p.add_argument(
        "--chunks", type=positive_int, default=None,
        help="chunks per rank for 1f1b-interleaved (default 2)",
    )


def add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cost", default=None, metavar="f=..,b=..,w=..,ar=..,comm=..",
        help="times of one microbatch through one rank's share (default f=b=w=1, ar=comm=0)",
    )
    p.add_argument(
        "--mem", default=None, metavar="b=..,w=..",
        help="activation memory per microbatch per rank share: M_B and the part M_W kept "
        "until W (default b=1,w=0)",
    )
    p.add_argument(
        "--layers", type=positive_int, default=1,
        help="transformer layers per model chunk; each gives two units (attention, MLP)",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME[,key=val..]",
        help="derive costs and memory from a model: a preset (zb-1.5b, zb-6.2b, zb-14.6b, "
        "zb-28.3b, qwen2-12.1b, qwen2-26.3b) and/or fields (layers, hidden, heads, kv_heads, "
        "ffn, vocab, sequence, micro_batch, tp, ...); --cost/--mem keys override the result",
    )
    p.add_argument(
        "--hardware", default=None, metavar="NAME[,key=val..]",
        help="hardware for --model: a100-80g (default) or a800-80g, and/or fields "
        "(peak_flops, efficiency, tp_bandwidth, tp_latency, pp_bandwidth, pp_latency, "
        "host_bandwidth)",
    )


def schedule_from_args(args: argparse.Namespace, name: str | None = None) -> Schedule:
    name = name or args.schedule
    opts: dict[str, object] = {}
    if getattr(args, "chunks", None) is not None:
        if name != "1f1b-interleaved":
            raise ValueError(f"--chunks applies to 1f1b-interleaved only, not {name}")
        opts["chunks"] = args.chunks
    return generate(name, args.pp, args.microbatches, **opts)


def costs_from_args(args: argparse.Namespace) -> tuple[Costs, MemCosts]:
    """--cost/--mem, on top of what --model/--hardware derive (stp.costmodel) if given."""
    model = getattr(args, "model", None)
    hardware = getattr(args, "hardware", None)
    if model is None:
        if hardware is not None:
            raise ValueError("--hardware needs --model (the model the costs are derived for)")
        return parse_costs(args.cost), parse_mem(args.mem)
    from stp.costmodel import derive, parse_hardware, parse_model

    pp = getattr(args, "pp", None)
    if pp is None:
        raise ValueError("--model needs --pp: costs are per pipeline rank's share of the model")
    derived = derive(parse_model(model), parse_hardware(hardware or "a100-80g"), pp)
    return parse_costs(args.cost, derived.costs), parse_mem(args.mem, derived.mem)
