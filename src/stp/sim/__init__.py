"""Discrete-event simulator of pipeline schedules with TP all-reduce. Imports no torch."""

from stp.sim.costs import Costs, MemCosts, OffloadCosts, parse_costs, parse_mem
from stp.sim.engine import simulate
from stp.sim.result import LANES, RankStats, SimResult, Span

__all__ = [
    "LANES",
    "Costs",
    "MemCosts",
    "OffloadCosts",
    "RankStats",
    "SimResult",
    "Span",
    "parse_costs",
    "parse_mem",
    "simulate",
]
