"""Schedules as data: the IR, the generators, validation. Imports no torch."""

from stp.schedule.ir import (
    Action,
    Block,
    Kind,
    Pass,
    Schedule,
    format_action,
    looped_placement,
    parse_action,
    passes_of,
    v_placement,
)
from stp.schedule.memory import MemCosts, peak_by_order
from stp.schedule.registry import SCHEDULES, generate, names
from stp.schedule.validate import ScheduleError, validate

__all__ = [
    "Action",
    "Block",
    "Kind",
    "MemCosts",
    "Pass",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "format_action",
    "generate",
    "looped_placement",
    "names",
    "parse_action",
    "passes_of",
    "peak_by_order",
    "v_placement",
    "validate",
]
