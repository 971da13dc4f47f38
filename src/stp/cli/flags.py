"""Command-line flags derived from a settings dataclass (one source of truth).

Each field made with `stp.train.run.config.option` becomes `--field-name` with the
field's default, help text and bounds; a nested dataclass field contributes
its own fields at the same level; a `bool` field is `--name on|off` (bare: on). Values
are checked as argparse arguments, so a bad one exits 2 with a line naming
the flag: numbers must be finite and within their bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["add_flags", "from_args"]


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the type, whether None is allowed) of an annotation like `int | None`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def _number(kind: type, meta: dict[str, Any]) -> Callable[[str], Any]:
    lo, above, hi = meta.get("minimum"), meta.get("above"), meta.get("maximum")

    def parse(text: str) -> Any:
        if not text.isascii():  # int() and float() read full-width and other digits
            raise argparse.ArgumentTypeError(f"{text!r}: write numbers in ASCII digits")
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"{text} must be >= {lo:g}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"{text} must be > {above:g}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"{text} must be <= {hi:g}")
        return value

    return parse


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: choose on or off")
    return text == "on"


def _add(parser: argparse.ArgumentParser, f: dataclasses.Field[Any], hint: Any,
         default: Any) -> None:
    meta = dict(f.metadata)
    kind, _ = _base_type(hint)
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    names = [flag] + ([meta["short"]] if meta.get("short") else [])
    help_text = meta.get("help", "")
    if default is not None:  # a caller's default replaces the field's described one
        help_text = re.sub(r" \(default[^)]*\)", "", help_text)
    kw: dict[str, Any] = {"dest": f.name, "default": default, "metavar": meta.get("metavar")}
    if kind is bool:
        # a bare --name means on (`stp train --sequence-parallel`)
        kw.update(type=_on_off, metavar="on|off", nargs="?", const=True)
        help_text += f" (default {'on' if default else 'off'})"
    elif kind in (int, float):
        kw["type"] = _number(kind, meta)
        kw["metavar"] = kw["metavar"] or ("N" if kind is int else "X")
        if default is not None:
            help_text += f" (default {default:g})"
    elif meta.get("choices"):
        kw["choices"] = meta["choices"]
        kw.pop("metavar")
        help_text += f" (default {default})"
    elif default is not None:
        help_text += f" (default {default})"
    parser.add_argument(*names, help=help_text, **kw)


def add_flags(parser: argparse.ArgumentParser, cls: type, defaults: Any = None,
              only: tuple[str, ...] | None = None) -> None:
    """Add one flag per field of dataclass `cls` (defaults from `defaults`, an
    instance, or the class's own; `only`: just these fields)."""
    defaults = defaults if defaults is not None else cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            add_flags(parser, hints[f.name], value)
        elif "help" in f.metadata:
            _add(parser, f, hints[f.name], value)


def from_args(cls: type, args: argparse.Namespace, **override: Any) -> Any:
    """An instance of dataclass `cls` from the flags `add_flags` made."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in override:
            values[f.name] = override[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = from_args(hints[f.name], args)
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values)
