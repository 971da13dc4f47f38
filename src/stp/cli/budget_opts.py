"""`--memory-budget SIZE` on simulate and search (with --model): the run's
bytes per rank (`stp.costmodel.memory`: model states, the simulated peak
activations, buffers) judged against a byte budget, refused in one line
naming the largest category (exit 2).

The byte estimate is of a bfloat16 run with neither sharded optimizer nor
data parallelism (`stp memory` takes those flags); activations come from the
very run simulated, so its schedule, partition, offload, recomputation and
sequence parallelism count.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stp.sim.result import SimResult

if TYPE_CHECKING:
    from stp.costmodel.decoder.spec import ModelSpec

__all__ = ["add_budget_arg", "budget_from_args", "check_budget", "limit_from_budget"]


def add_budget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="with --model: refuse (exit 2) a run whose peak rank needs more bytes "
                   "than SIZE (bytes, or 80GB, 80GiB; see `stp memory`)")


def budget_from_args(args: argparse.Namespace) -> float | None:
    """The budget in bytes, or None; ValueError without --model or for a bad size."""
    text = getattr(args, "memory_budget", None)
    if text is None:
        return None
    from stp.costmodel.budget import parse_size

    size = parse_size(text)
    if args.model is None:
        raise ValueError("--memory-budget needs --model (bytes come from the model's shape)")
    return size


def _spec_and_unit(args: argparse.Namespace, pp: int) -> tuple[ModelSpec, float]:
    from stp.cli.common import model_from_args
    from stp.costmodel import derive, parse_hardware
    from stp.costmodel.decoder.spec import decoder_only

    spec = decoder_only(model_from_args(args), "--memory-budget")
    from dataclasses import replace

    # memory figures are in units of M_B without recomputation when the search chose it
    base = replace(spec, recompute="none") if getattr(args, "recompute", None) == "auto" else spec
    return spec, derive(base, parse_hardware(args.hardware or "a100-80g"), pp).bytes_per_unit


def check_budget(args: argparse.Namespace, res: SimResult) -> None:
    """ValueError (one line) when the simulated run `res` exceeds --memory-budget."""
    budget = budget_from_args(args)
    if budget is None:
        return
    from stp.costmodel.budget import over_budget
    from stp.costmodel.decoder.memory import memory_of_run
    from stp.costmodel.memory import Features

    spec, unit = _spec_and_unit(args, res.schedule.num_ranks)
    feats = Features(sequence_parallel=spec.sequence_parallel,
                     offload=getattr(args, "offload", "none"))
    est = memory_of_run(spec, res, unit, feats)
    verdict = over_budget(est, budget)
    if verdict is not None:
        raise ValueError(f"{res.schedule.name}: {verdict} (--memory-budget)")


def limit_from_budget(args: argparse.Namespace, budget: float) -> float:
    """An activation limit (units of M_B) from a byte budget: what the largest
    rank's model states and buffers leave, under the V placement's partition."""
    from stp.costmodel import parse_hardware
    from stp.costmodel.memory import Features, Layout, estimate, format_bytes

    spec, unit = _spec_and_unit(args, args.pp)
    lay = Layout(pp=args.pp, tp=spec.tp, microbatches=args.microbatches,
                 microbatch_size=spec.micro_batch, seq_len=spec.sequence,
                 schedule="zb-v")
    est = estimate(spec, parse_hardware(args.hardware or "a100-80g"), lay,
                   Features(sequence_parallel=spec.sequence_parallel))
    states = max(r.total - r.activations_peak for r in est.ranks)
    if states >= budget:
        raise ValueError(f"--memory-budget {format_bytes(budget)}: the model states and "
                         f"buffers alone need {format_bytes(states)} on one rank")
    return (budget - states) / unit
