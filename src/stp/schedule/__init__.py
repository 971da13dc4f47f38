"""Schedules as data: the IR, the generators, validation. Imports no torch."""

from stp.schedule.io import parse_action
from stp.schedule.ir import (
    Action,
    Block,
    Done,
    Kind,
    Pass,
    Schedule,
    format_action,
    looped_placement,
    passes_of,
    v_placement,
)
from stp.schedule.memory import MemCosts, peak_by_order
from stp.schedule.placement import partition_layers, stage_layers
from stp.schedule.registry import SCHEDULES, generate, make, names
from stp.schedule.validate import ScheduleError, validate

__all__ = [
    "Action",
    "Block",
    "Done",
    "Kind",
    "MemCosts",
    "Pass",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "format_action",
    "generate",
    "looped_placement",
    "make",
    "names",
    "parse_action",
    "partition_layers",
    "passes_of",
    "peak_by_order",
    "stage_layers",
    "v_placement",
    "validate",
]
