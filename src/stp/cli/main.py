"""`stp` entry point: dispatches to subcommand modules.

Each module in SUBCOMMANDS defines `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. User mistakes (ValueError) become one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from importlib import import_module
from typing import Any, NoReturn

from stp import __version__
from stp.cli.common import EXIT_USAGE

__all__ = ["main", "build_parser", "CliError"]

SUBCOMMANDS = (
    "stp.cli.schedules",
    "stp.cli.simulate",
    "stp.cli.draw",
    "stp.cli.export",
    "stp.cli.search",
    "stp.cli.costs",
    "stp.cli.memory",
    "stp.cli.plan",
    "stp.cli.train",
    "stp.cli.data",
    "stp.cli.bench",
)


class CliError(ValueError):
    """A user error the CLI reports in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with stp's conventions, for every subcommand's parser too: a
    flag is spelled out (argparse's abbreviations would let `--step` quietly
    mean `--steps`, and a new flag could change what an old command line
    means); a misspelled flag is answered with the nearest real one; errors
    are raised for `main` to print as one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # The innermost parser sees an unknown flag first and knows the flags
        # it could have meant; unmatched ones go up to be refused as argparse does.
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        self._suggest(extras)
        return namespace, extras

    def _suggest(self, words: list[str]) -> None:
        longs = [o for o in self._option_string_actions if o.startswith("--")]
        for word in words:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag not in self._option_string_actions:
                near = difflib.get_close_matches(flag, longs, n=1)
                if near:
                    raise CliError(self._where(f"unrecognized argument {word}; "
                                               f"did you mean {near[0]}?"))

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            # A misspelled required flag is the likelier cause: name it instead.
            self._suggest(getattr(self, "_given", []))
        raise CliError(self._where(message))

    def _where(self, message: str) -> str:
        # One line, `stp: error:` once (main prints it), naming the subcommand.
        command = self.prog.removeprefix("stp").strip()
        return f"{command}: {message}" if command else message


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stp",
        description="Synergistic tensor and pipeline parallelism: schedules, simulator, runtime.",
    )
    parser.add_argument("--version", action="version", version=f"stp {__version__}")
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
    except OSError as e:  # the machine refused a write (full disk, a file-size limit): one line
        where = f" ({e.filename})" if e.filename else ""
        print(f"stp: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
