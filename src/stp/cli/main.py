"""`stp` entry point: dispatches to subcommand modules.

Each module in SUBCOMMANDS defines `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. User mistakes (ValueError) become one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from stp.cli.common import EXIT_USAGE

__all__ = ["main", "build_parser", "CliError"]

SUBCOMMANDS = (
    "stp.cli.schedules",
    "stp.cli.simulate",
    "stp.cli.draw",
    "stp.cli.export",
    "stp.cli.search",
    "stp.cli.costs",
    "stp.cli.train",
    "stp.cli.bench",
)


class CliError(ValueError):
    """A user error the CLI reports in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One clear line instead of argparse's usage block.
        raise CliError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stp",
        description="Synergistic tensor and pipeline parallelism: schedules, simulator, runtime.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for mod_name in SUBCOMMANDS:
        import_module(mod_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (CliError, ValueError) as e:
        print(f"stp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("stp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
