"""`--offload` options shared by simulate, compare and draw."""

from __future__ import annotations

import argparse

from stp.cli.common import MAX_VALUE, positive_float
from stp.schedule import Schedule
from stp.schedule.offload import POLICIES, OffloadPlan
from stp.sim.costs import Costs, MemCosts, OffloadCosts
from stp.sim.offload import plan_offload
from stp.sim.stages import StageCosts

__all__ = ["add_offload_args", "offload_from_args"]


def add_offload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--offload", default="none", metavar="POLICY",
        help=f"activation offload policy: {', '.join(POLICIES)} (default none)",
    )
    p.add_argument(
        "--offload-bandwidth", type=positive_float, default=1.0, metavar="BYTES_PER_T",
        help="host link bytes per time unit of --cost, each direction (default 1)",
    )
    p.add_argument(
        "--act-bytes", type=positive_float, default=1.0, metavar="BYTES",
        help="bytes of one M_B, one microbatch's activations for one rank's share "
        "(default 1: a copy of one M_B then takes one time unit)",
    )


def offload_from_args(
    args: argparse.Namespace, schedule: Schedule, costs: Costs, mem: MemCosts,
    stages: StageCosts | None = None,
) -> tuple[OffloadPlan | None, OffloadCosts]:
    if not args.offload.isascii():  # float() would read full-width digits in selective:X
        raise ValueError(f"--offload {ascii(args.offload)}: ASCII expected, e.g. selective:0.3")
    oc = OffloadCosts(bandwidth=args.offload_bandwidth, act_bytes=args.act_bytes)
    copy = oc.copy_time(mem.m_b)  # each flag is bounded; their ratio may still overflow
    if not copy <= MAX_VALUE:
        raise ValueError(
            f"--act-bytes {args.act_bytes:g} / --offload-bandwidth {args.offload_bandwidth:g}"
            f" makes a copy of M_B take {copy:g} time units; at most {MAX_VALUE:g} accepted"
        )
    plan = plan_offload(schedule, args.offload, costs, mem, oc, layers=args.layers,
                        stages=stages)
    return (plan if len(plan) else None), oc
