"""Per-stage cost options of simulate, compare, draw and search.

    --partition auto|L0,L1,...   layers per global stage (with --model, or
                                 explicit counts scaling --cost per layer)
    --stage-costs FILE.json      a per-stage cost table (stp.sim.stages format)
    --costs-from TRACE.json      the table measured by `stp train --trace`

Without any of them and without --model the uniform --cost is simulated as
before. With --model every stage gets its own costs: its layers, the
embedding on the first stage, the output layer and loss on the last
(`stp.costmodel.stages`), the even split unless --partition says otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from stp.schedule import Schedule
from stp.schedule.memory import MemCosts
from stp.search.partition import AutoPartition, auto_partition, balanced_partition
from stp.sim.costs import Costs
from stp.sim.layered import (
    LayeredCosts,
    Partition,
    check_partition,
    even_partition,
    parse_partition,
)
from stp.sim.stages import StageCosts, load_stage_costs

__all__ = ["StageInputs", "add_stage_args", "parse_partition", "stage_inputs"]



def add_stage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--partition", default=None, metavar="auto|L0,L1,..",
        help="transformer layers per global stage: `auto` (needs --model) picks the counts "
        "with the shortest simulated step within --memory-limit; explicit counts sum to the "
        "model's layers (with --model) and scale --cost per layer",
    )
    p.add_argument("--stage-costs", default=None, metavar="FILE.json",
                   help="every global stage's own costs and memory (format in docs/schedules.md)")
    p.add_argument("--costs-from", default=None, metavar="TRACE.json",
                   help="per-stage costs measured by `stp train --trace` (as `stp costs`)")


@dataclass(frozen=True)
class StageInputs:
    """Where each schedule's per-stage costs come from (`stage_inputs`)."""

    layered: LayeredCosts | None = None
    """Costs per layer, from --model or an explicit --partition."""
    table: StageCosts | None = None
    """A fixed table (--stage-costs / --costs-from)."""
    where: str = ""
    """The flag and file of the fixed table, for messages."""
    partition: Partition | None = None
    layers: int = 1
    memory_limit: float | None = None

    @property
    def uniform(self) -> bool:
        return self.layered is None and self.table is None

    def reported(self, costs: Costs, mem: MemCosts, num_ranks: int) -> tuple[Costs, MemCosts]:
        """The uniform costs a run reports: a fixed table's average rank share,
        else `costs`, `mem`."""
        if self.table is None:
            return costs, mem
        return self.table.mean_costs(num_ranks), self.table.mean_mem(num_ranks)

    def counts(self, num_stages: int) -> tuple[int, ...]:
        """The explicit or even partition of a schedule with `num_stages` stages
        (`auto`: the classic balanced one, before the simulator's judgement)."""
        assert self.layered is not None
        total = self.layered.num_layers
        if isinstance(self.partition, tuple):
            return check_partition(self.partition, num_stages, total)
        assert total is not None
        if total < num_stages:
            raise ValueError(f"the model's {total} layers cannot fill {num_stages} stages of "
                             "at least one layer each; use fewer ranks or a larger model")
        if self.partition == "auto":
            return balanced_partition(self.layered, total, num_stages)
        return even_partition(total, num_stages)

    def for_stages(self, num_stages: int) -> StageCosts:
        """The table of a schedule with `num_stages` global stages (the search's
        `stage_costs`); ValueError when a fixed table has another count."""
        if self.table is not None:
            self.table.check_fits(num_stages, self.where)
            return self.table
        assert self.layered is not None
        return self.layered.table(self.counts(num_stages))

    def for_schedule(self, sch: Schedule) -> tuple[StageCosts | None, AutoPartition | None]:
        """(the table to simulate `sch` with, None: uniform; the auto
        partition's outcome when `auto` chose it)."""
        if self.uniform:
            return None, None
        if self.partition == "auto":
            assert self.layered is not None and self.layered.num_layers is not None
            if self.layered.num_layers < sch.num_stages:
                self.counts(sch.num_stages)  # the one-line refusal
            got = auto_partition(sch, self.layered, self.layered.num_layers,
                                 layers=self.layers, memory_limit=self.memory_limit)
            return self.layered.table(got.counts), got
        return self.for_stages(sch.num_stages), None


def _fixed_table(args: argparse.Namespace) -> tuple[StageCosts, str] | None:
    given = [(f, v) for f, v in (("--stage-costs", getattr(args, "stage_costs", None)),
                                 ("--costs-from", getattr(args, "costs_from", None)))
             if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("give --stage-costs FILE or --costs-from TRACE, not both")
    flag, path = given[0]
    clash = [f for f, v in (("--model", args.model), ("--cost", args.cost), ("--mem", args.mem),
                            ("--partition", getattr(args, "partition", None))) if v is not None]
    if clash:
        raise ValueError(f"{flag} gives every stage's costs; drop {', '.join(clash)}")
    if flag == "--stage-costs":
        return load_stage_costs(path), f"{flag} {path}"
    from stp.costmodel.measured import load_measured

    return load_measured(path), f"{flag} {path}"


def stage_inputs(args: argparse.Namespace, costs: Costs, mem: MemCosts, num_ranks: int | None,
                 memory_limit: float | None = None) -> StageInputs:
    """The per-stage cost source the flags name (see the module doc);
    `costs`/`mem` are what `costs_from_args` gave (one rank's share)."""
    layers = getattr(args, "layers", 1)
    fixed = _fixed_table(args)
    if fixed is not None:
        return StageInputs(table=fixed[0], where=fixed[1], layers=layers,
                           memory_limit=memory_limit)
    text = getattr(args, "partition", None)
    part = None if text is None else parse_partition(text)
    if args.model is None and part is None:
        return StageInputs(layers=layers)
    if num_ranks is None:
        raise ValueError("--partition needs --pp (costs are per rank's share)")
    if args.model is not None:
        from stp.cli.common import model_from_args
        from stp.costmodel import parse_hardware
        from stp.costmodel.stages import layered_costs

        model = model_from_args(args)
        _check_partition_sum(model, part)
        layered = layered_costs(model, parse_hardware(args.hardware or "a100-80g"), num_ranks,
                                costs, mem, layers)
    elif part == "auto":
        raise ValueError("--partition auto needs --model: with --cost alone every layer "
                         "costs the same and there is nothing to balance")
    else:
        assert isinstance(part, tuple)
        layered = LayeredCosts.from_rank_share(costs, mem, num_ranks, max(1, sum(part)),
                                               layers=layers, known_layers=False)
    return StageInputs(layered=layered, partition=part, layers=layers,
                       memory_limit=memory_limit)


def _check_partition_sum(model: object, part: object) -> None:
    """An explicit partition checked in the model family's own words (a multimodal
    model counts encoder blocks and decoder layers together)."""
    from stp.costmodel.families import costs_of

    if isinstance(part, tuple):
        costs_of(model).check_partition(model, part)


def partition_text(counts: tuple[int, ...] | None) -> str:
    return "-" if counts is None else ",".join(map(str, counts))


def describe(stages: StageCosts | None, auto: AutoPartition | None) -> list[str]:
    """Lines saying which per-stage costs a run used (none for uniform costs)."""
    if stages is None:
        return []
    lines = []
    if stages.partition is not None:
        line = f"partition {partition_text(stages.partition)} (layers per global stage)"
        if auto is not None:
            even = auto.even
            line += (f"; auto: makespan {auto.result.makespan:.4g} vs even split "
                     f"{partition_text(even.stages.partition if even.stages else None)} "
                     f"{even.makespan:.4g}")
        lines.append(line)
    per = " ".join(f"{s.f + s.b + s.w:.3g}" for s in stages.stages[:16])
    more = " ..." if stages.num_stages > 16 else ""
    lines.append(f"per-stage f+b+w: {per}{more}")
    return lines


def auto_json(auto: AutoPartition | None) -> dict[str, object]:
    """What `--json` adds for `--partition auto`."""
    if auto is None:
        return {}
    even = auto.even.stages
    return {"partition_mode": "auto",
            "even_partition": None if even is None else list(even.partition or ()),
            "even_makespan": auto.even.makespan, "partitions_simulated": auto.simulated}


def check_table_work(stages: StageCosts | None, sch: Schedule, where: str) -> None:
    """The work limits of `stp.cli.common.check_work` for a table's own units."""
    if stages is None:
        return
    from stp.cli.common import check_work

    layers = max((s.units + 1) // 2 for s in stages.stages)
    check_work(sch.num_stages, sch.num_microbatches, layers, where)
