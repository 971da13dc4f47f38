"""`stp schedules`: list the schedule names, one line each."""

from __future__ import annotations

import argparse

from stp.schedule.registry import SCHEDULES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedules", help="list the schedules stp can generate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    width = max(len(n) for n in SCHEDULES)
    for name, spec in SCHEDULES.items():
        print(f"{name:<{width}}  {spec.summary}")
    return 0
