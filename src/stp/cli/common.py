"""Options shared by the schedule/simulator subcommands (simulate, compare, draw, ...).

Every number a flag takes is checked as an argparse argument, so a bad one
exits 2 with one line naming the flag: integers and numbers are ASCII (Python
would read full-width digits), finite and within the limits below. The limits
bound the work a command does before it starts: simulating a schedule costs
about 15 us per pass plus 1.3 us per pass and layer on one core, and a
schedule of S stages and m microbatches has up to 3 S m passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable

from stp.schedule import SCHEDULES, Schedule, generate
from stp.schedule.limits import MAX_MICROBATCHES, MAX_RANKS
from stp.sim.costs import Costs, MemCosts, parse_costs, parse_mem

__all__ = [
    "add_schedule_args", "add_size_args", "add_cost_args", "schedule_from_args",
    "costs_from_args", "check_work", "generated_stages", "int_in", "number_in",
    "positive_int", "positive_float", "pp_count", "microbatch_count", "chunk_count",
    "layer_count", "model_from_args", "MAX_CHUNKS", "MAX_LAYERS", "MAX_STAGE_MICROBATCHES",
    "MAX_STAGE_MICROBATCH_LAYERS", "MAX_VALUE", "EXIT_USAGE",
]

EXIT_USAGE = 2
"""Bad input, refused in one line before any work (argparse's status too)."""

MAX_CHUNKS = 16
"""Most chunks per rank (--chunks): with 64 ranks, the 1024 stages a file may name."""
MAX_LAYERS = 64
"""Most transformer layers per chunk (--layers)."""
MAX_STAGE_MICROBATCHES = 32768
"""Most stages x microbatches simulated: up to 98304 passes, about 3 s for
one schedule (compare: each of twelve) on a 2-core VM."""
MAX_STAGE_MICROBATCH_LAYERS = 262144
"""Most stages x microbatches x layers per chunk simulated (the units)."""
MAX_VALUE = 1e12
"""Largest cost, memory, bandwidth or limit value: far above any real one, and
small enough that sums over every pass of a schedule stay finite (1e308
values overflow)."""


def _ascii_number(text: str, kind: type) -> float | int:
    what = "an integer" if kind is int else "a number"
    if not text.isascii():
        raise argparse.ArgumentTypeError(f"{ascii(text)} is not {what} (ASCII digits expected)")
    try:
        return kind(text)
    except ValueError:  # also an integer of more than 4300 digits
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {what}") from None


def mean_doc_len(text: str) -> int:
    """--mean-doc-len: tokens per document, or the `.hist.json` `stp data prepare`
    wrote beside a dataset (its PREFIX too), whose mean is taken."""
    from pathlib import Path

    from stp.files import read_json_object

    if text.isdigit():
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give tokens per document >= 1")
        return int(text)
    path = Path(text if text.endswith(".hist.json") else f"{text}.hist.json")
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a token count nor a dataset with a .hist.json beside it "
            "(`stp data prepare` writes one)")
    try:
        mean = read_json_object(path, 1 << 20).get("mean_length")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not mean >= 1:
        raise argparse.ArgumentTypeError(f"{path}: no mean_length >= 1 in it")
    return max(1, round(mean))


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an ASCII integer in lo..hi."""

    def parse(text: str) -> int:
        val = int(_ascii_number(text, int))
        shown = str(val) if len(text) <= 20 else text[:20] + "..."
        if val < lo:
            raise argparse.ArgumentTypeError(f"{shown} must be >= {lo}")
        if hi is not None and val > hi:
            raise argparse.ArgumentTypeError(f"{shown} is beyond {hi}, the most accepted")
        return val

    return parse


def number_in(lo: float, hi: float, *, lo_open: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite ASCII number in (lo, hi] (or [lo, hi])."""

    def parse(text: str) -> float:
        val = float(_ascii_number(text, float))
        low_ok = val > lo if lo_open else val >= lo
        if not (math.isfinite(val) and low_ok and val <= hi):
            side = ">" if lo_open else ">="
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r}: accepted are finite numbers {side} {lo:g} and <= {hi:g}"
            )
        return val

    return parse


positive_int = int_in(1)
"""An integer >= 1 (no upper bound: for counts whose work another limit bounds)."""
positive_float = number_in(0.0, MAX_VALUE)
"""A finite number > 0 and <= MAX_VALUE."""
pp_count = int_in(1, MAX_RANKS)
microbatch_count = int_in(1, MAX_MICROBATCHES)
chunk_count = int_in(1, MAX_CHUNKS)
layer_count = int_in(1, MAX_LAYERS)


def add_schedule_args(p: argparse.ArgumentParser, *, schedule_required: bool = True) -> None:
    p.add_argument(
        "--schedule", required=schedule_required, help="schedule name (see `stp schedules`)"
    )
    add_size_args(p)


def add_size_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """--pp, --microbatches/-m and --chunks, each with its maximum."""
    p.add_argument("--pp", type=pp_count, required=required,
                   help=f"pipeline ranks p (at most {MAX_RANKS})")
    p.add_argument("--microbatches", "-m", type=microbatch_count, required=required,
                   help=f"microbatches m (at most {MAX_MICROBATCHES})")
    p.add_argument(
        "--chunks", type=chunk_count, default=None,
        help="chunks per rank for 1f1b-interleaved, looped-bfs and zb-interleaved "
        f"(default 2, at most {MAX_CHUNKS})",
    )


def add_cost_args(p: argparse.ArgumentParser, *, recompute_auto: bool = False) -> None:
    p.add_argument(
        "--cost", default=None, metavar="f=..,b=..,w=..,ar=..,comm=..",
        help="times of one microbatch through one rank's share (default f=b=w=1, ar=comm=0; "
        "ag/rs: sequence parallelism's collectives, a2a: expert parallelism's all-to-alls, "
        f"of one F or B pass; each a number 0..{MAX_VALUE:g})",
    )
    p.add_argument(
        "--mem", default=None, metavar="b=..,w=..",
        help="activation memory per microbatch per rank share: M_B and the part M_W kept "
        "until W (default b=1,w=0)",
    )
    p.add_argument(
        "--layers", type=layer_count, default=1,
        help="transformer layers per model chunk; each gives two units (attention, MLP); "
        f"at most {MAX_LAYERS}",
    )
    p.add_argument(
        "--model", default=None, metavar="NAME[,key=val..]",
        help="derive costs and memory from a model: a preset (zb-1.5b, zb-6.2b, zb-14.6b, "
        "zb-28.3b, qwen2-12.1b, qwen2-26.3b; multimodal: mllm-qwen2vl-7b with images, "
        "resolution, ...; mixture of experts: mixtral-8x7b, qwen2-57b-a14b with ep, "
        "experts, top_k, ...) and/or fields (layers, hidden, heads, kv_heads, ffn, vocab, "
        "sequence, micro_batch, tp, ...); --cost/--mem keys override the result",
    )
    p.add_argument(
        "--hardware", default=None, metavar="NAME[,key=val..]",
        help="hardware for --model: a100-80g (default), a800-80g or h100-80g, and/or fields "
        "(peak_flops, efficiency, tp_bandwidth, tp_latency, pp_bandwidth, pp_latency, "
        "host_bandwidth, memory, node_gpus)",
    )
    p.add_argument(
        "--recompute", default=None,
        choices=("none", "selective", "full", *(("auto",) if recompute_auto else ())),
        help="with --model: activation recomputation (selective: the attention core; full: "
        "the whole layer from its input), charged to B and taken off M_B / M_W"
        + ("; auto: per stage, what the memory limit needs (memory in M_B without "
           "recomputation)" if recompute_auto else ""),
    )


def check_work(stages: int, microbatches: int, layers: int, what: str) -> None:
    """Refuse, before generating or simulating, a schedule past the work limits.
    `what` names the flags the sizes came from."""
    sm = stages * microbatches
    if sm > MAX_STAGE_MICROBATCHES:
        raise ValueError(
            f"{what}: {stages} stages x {microbatches} microbatches = {sm}; at most "
            f"{MAX_STAGE_MICROBATCHES} are simulated (about 3 s per schedule at that size)"
        )
    if sm * layers > MAX_STAGE_MICROBATCH_LAYERS:
        raise ValueError(
            f"{what}, --layers {layers}: {stages} stages x {microbatches} microbatches x "
            f"{layers} layers = {sm * layers}; at most {MAX_STAGE_MICROBATCH_LAYERS} are "
            "simulated"
        )


def generated_stages(args: argparse.Namespace) -> int:
    """Stages of a generated schedule, counted before generating: --chunks when
    given, else two per rank (the V schedules' and 1f1b-interleaved's default)."""
    return args.pp * max(2, getattr(args, "chunks", None) or 2)


def schedule_from_args(args: argparse.Namespace, name: str | None = None) -> Schedule:
    name = name or args.schedule
    opts: dict[str, object] = {}
    if getattr(args, "chunks", None) is not None:
        takers = [n for n, spec in SCHEDULES.items() if spec.takes_chunks]
        if name not in takers:
            raise ValueError(f"--chunks applies to {', '.join(takers)} only, not {name}")
        opts["chunks"] = args.chunks
    check_work(generated_stages(args), args.microbatches, getattr(args, "layers", 1),
               f"--pp {args.pp} -m {args.microbatches}")
    return generate(name, args.pp, args.microbatches, **opts)


def _check_kv(text: str | None, flag: str, keys: tuple[str, ...]) -> None:
    """Refuse what parse_costs/parse_mem would let through: a repeated key (the
    last would win silently), NaN, infinities, values past MAX_VALUE (their sums
    overflow) and non-ASCII digits; and name a malformed item, briefly."""
    if text is None:
        return
    if not text.isascii():
        raise ValueError(f"{flag} {ascii(text[:60])}: ASCII KEY=VALUE items expected")
    seen: set[str] = set()
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, val = (s.strip() for s in item.partition("="))
        if not sep:
            raise ValueError(f"{flag} item {item[:40]!r} is not KEY=VALUE (keys: "
                             f"{', '.join(keys)})")
        if key not in keys:
            raise ValueError(f"{flag}: unknown key {key[:20]!r}; accepted: {', '.join(keys)}")
        if key in seen:
            raise ValueError(f"{flag} gives {key} twice; give each key once")
        seen.add(key)
        try:
            num = float(val)
        except ValueError:
            raise ValueError(f"{flag} {key}={val[:40]!r} is not a number") from None
        if not (math.isfinite(num) and 0 <= num <= MAX_VALUE):
            raise ValueError(f"{flag} {key}={val[:40]}: accepted are finite numbers "
                             f"0..{MAX_VALUE:g}")


def _check_derived(costs: Costs, mem: MemCosts) -> None:
    values = {**{f"cost {k}": v for k, v in dataclasses.asdict(costs).items()},
              "memory b": mem.m_b, "memory w": mem.m_w}
    for what, val in values.items():
        if not (math.isfinite(val) and val <= MAX_VALUE):
            raise ValueError(f"--model/--hardware give {what}={val:g}, beyond {MAX_VALUE:g}; "
                             "check the fields' units")


def costs_from_args(args: argparse.Namespace) -> tuple[Costs, MemCosts]:
    """--cost/--mem, on top of what --model/--hardware derive (stp.costmodel) if given."""
    _check_kv(args.cost, "--cost", tuple(f.name for f in dataclasses.fields(Costs)))
    _check_kv(args.mem, "--mem", ("b", "w"))
    model = getattr(args, "model", None)
    hardware = getattr(args, "hardware", None)
    if model is None:
        if getattr(args, "recompute", None) is not None:
            raise ValueError("--recompute needs --model (its formulas are per layer shape)")
        if hardware is not None:
            raise ValueError("--hardware needs --model (the model the costs are derived for)")
        return parse_costs(args.cost), parse_mem(args.mem)
    from stp.costmodel import derive, parse_hardware

    for flag, text in (("--model", model), ("--hardware", hardware or "")):
        if not text.isascii():
            raise ValueError(f"{flag} {ascii(text)}: ASCII NAME[,key=val..] expected")
    pp = getattr(args, "pp", None)
    if pp is None:
        raise ValueError("--model needs --pp: costs are per pipeline rank's share of the model")
    derived = derive(model_from_args(args), parse_hardware(hardware or "a100-80g"), pp)
    _check_derived(derived.costs, derived.mem)
    return parse_costs(args.cost, derived.costs), parse_mem(args.mem, derived.mem)


def model_from_args(args: argparse.Namespace) -> object:
    """The --model spec, with --recompute applied (a decoder's field)."""
    from stp.costmodel import parse_model
    from stp.costmodel.decoder.spec import decoder_only

    spec = parse_model(args.model)
    mode = getattr(args, "recompute", None)
    if mode in (None, "auto"):  # auto: the search's choice (stp.search.recompute)
        return spec
    spec = decoder_only(spec, "--recompute")
    return dataclasses.replace(spec, recompute=mode)
