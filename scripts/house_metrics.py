"""The house figures: how hard the code is to see and change, counted from the
source alone (nothing is imported or run), each printed with how it is counted.

    python scripts/house_metrics.py                  # this checkout
    python scripts/house_metrics.py --root DIR       # another checkout (e.g. a git worktree
                                                     # of an older commit, for a "before")
    python scripts/house_metrics.py --json           # the figures as one JSON object

docs/architecture.md ("The house in figures") holds a before / after table
made with it; tests/test_house_metrics.py runs it on this repository and
checks its counting on a small planted tree.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

FAMILY_CLASSES = frozenset({
    "ModelConfig", "MLLMConfig", "MoEConfig", "VisionConfig",
    "ModelSpec", "MLLMSpec", "MoESpec",
    "ModelStage", "MLLMStage", "MoEStage",
})
"""The model families' config, cost-model spec and stage classes."""
FAMILIES = ("decoder", "mllm", "moe")
PROBED = frozenset({"stage", "spec", "config", "cfg", "job", "family", "fam"})
"""Words that name the receiver of a capability probe (`self.stage`, `dec_spec`)."""
ANY_NAMES = frozenset({"job", "run", "config", "spec", "stage", "family"})
LONG = 400
"""Lines above which a file counts as long (the house rule: files under 400 lines)."""
DUP_LINES = 6
"""Identical significant lines that make a duplicate."""
DUP_TOO_COMMON = 8
"""A run standing in more places than this is boilerplate, not a duplicate."""

HOW = {
    "family_class_tests": (
        "calls isinstance(x, C) / issubclass(x, C) and comparisons type(x) is / == C, C one "
        f"of the families' classes ({', '.join(sorted(FAMILY_CLASSES))}), in files that are "
        "not a family's own (own: under stp/shapes/, stp/models/<family>/, "
        "stp/train/families/, or a file or folder named after the family)"),
    "capability_probes": (
        "getattr(obj, 'name', ...) / hasattr(obj, 'name') with a constant name, obj a name "
        "or attribute one of whose _-separated words is "
        f"{', '.join(sorted(PROBED))}, in files that are not a family's own"),
    "any_parameters": (
        "function parameters annotated Any (alone, or Any | None / Optional[Any]) named "
        f"{', '.join(sorted(ANY_NAMES))}, in all of src/stp"),
    "long_files": f"files of src/stp with more than {LONG} lines",
    "train_floor_modules": ".py files directly in src/stp/train/ (its __init__.py included)",
    "duplicates": (
        f"pairs of places in src/stp sharing a run of {DUP_LINES} or more identical "
        "significant lines (blank lines, comments, docstring-only lines, imports and lone "
        f"punctuation skipped; white space folded; a run found in more than {DUP_TOO_COMMON} "
        "places is left out as boilerplate); the longest are listed"),
}


@dataclass
class Figures:
    family_class_tests: list[str] = field(default_factory=list)
    capability_probes: list[str] = field(default_factory=list)
    any_parameters: list[str] = field(default_factory=list)
    long_files: list[str] = field(default_factory=list)
    train_floor_modules: list[str] = field(default_factory=list)
    duplicates: list[tuple[int, str]] = field(default_factory=list)


def _words(node: ast.AST) -> set[str]:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return set(name.lower().split("_"))


def _class_names(node: ast.AST | None) -> set[str]:
    """The bare names in an isinstance class argument (a name, x.Name, or a tuple)."""
    if node is None:
        return set()
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    return {getattr(k, "id", getattr(k, "attr", None)) for k in items} - {None}


def _is_any(ann: ast.AST | None) -> bool:
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        text = ann.value.replace(" ", "")
        return text in ("Any", "Any|None", "None|Any", "Optional[Any]", "typing.Any")
    if isinstance(ann, ast.Name | ast.Attribute):
        return (ann.id if isinstance(ann, ast.Name) else ann.attr) == "Any"
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        sides = (ann.left, ann.right)
        return any(_is_any(s) for s in sides) and all(
            _is_any(s) or (isinstance(s, ast.Constant) and s.value is None) for s in sides)
    if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Optional":
        return _is_any(ann.slice)
    return False


def own_file(rel: Path) -> bool:
    """A family's own file: its config, its models package, its job half, or a file or
    folder named after it (costmodel's per-family files)."""
    parts = rel.parts
    if parts[:1] == ("shapes",) or parts[:2] == ("train", "families"):
        return True
    if parts[:1] == ("models",) and len(parts) > 2 and parts[1] in FAMILIES:
        return True
    return any(p.split(".")[0].startswith(FAMILIES) for p in parts[1:])


def _type_is(node: ast.Compare) -> bool:
    """`type(x) is C` / `type(x) == C` with C a family class."""
    left = node.left
    if not (isinstance(left, ast.Call) and getattr(left.func, "id", None) == "type"):
        return False
    return any(isinstance(op, ast.Is | ast.Eq | ast.IsNot | ast.NotEq) for op in node.ops) and \
        bool(_class_names(node.comparators[0]) & FAMILY_CLASSES)


def scan_file(path: Path, rel: Path, figs: Figures) -> None:
    text = path.read_text(encoding="utf-8")
    if len(text.splitlines()) > LONG:
        figs.long_files.append(f"{rel} {len(text.splitlines())}")
    if rel.parts[0] == "train" and len(rel.parts) == 2:
        figs.train_floor_modules.append(str(rel))
    tree = ast.parse(text, str(path))
    shared = not own_file(rel)
    for node in ast.walk(tree):
        where = f"stp/{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                if a.arg in ANY_NAMES and _is_any(a.annotation):
                    figs.any_parameters.append(f"stp/{rel}:{a.lineno} {node.name}({a.arg})")
        if not shared:
            continue
        if isinstance(node, ast.Call):
            fn = getattr(node.func, "id", None)
            if fn in ("isinstance", "issubclass") and len(node.args) > 1 and \
                    _class_names(node.args[1]) & FAMILY_CLASSES:
                figs.family_class_tests.append(
                    f"{where} {fn} {sorted(_class_names(node.args[1]) & FAMILY_CLASSES)}")
            if fn in ("getattr", "hasattr") and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) and \
                    isinstance(node.args[1].value, str) and \
                    isinstance(node.args[0], ast.Name | ast.Attribute) and \
                    _words(node.args[0]) & PROBED:
                figs.capability_probes.append(f"{where} {fn} {node.args[1].value!r}")
        if isinstance(node, ast.Compare) and _type_is(node):
            figs.family_class_tests.append(f"{where} type() is")


# -- duplicates ---------------------------------------------------------------------


def _significant(text: str) -> list[tuple[int, str]]:
    """(line number, the line with white space folded) of the lines that count."""
    out = []
    in_doc = False
    for n, raw in enumerate(text.splitlines(), 1):
        line = " ".join(raw.split())
        quotes = line.count('"""') + line.count("'''")
        if in_doc or (quotes and line.startswith(('"""', "'''", 'r"""'))):
            if quotes % 2 == 1:
                in_doc = not in_doc
            continue
        if not line or line.startswith(("#", "import ", "from ")) or \
                all(c in "()[]{}:,;" for c in line):
            continue
        out.append((n, line))
    return out


def _runs(files: dict[str, list[tuple[int, str]]]) -> Iterator[tuple[int, str]]:
    """(length, 'a.py:10-24 ~ b.py:40-54') of every maximal run of identical significant
    lines, at least DUP_LINES long, that two places share."""
    where: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in files.items():
        texts = [t for _, t in lines]
        for i in range(len(texts) - DUP_LINES + 1):
            where[tuple(texts[i:i + DUP_LINES])].append((name, i))
    seen: set[tuple[str, int, str, int]] = set()
    for places in where.values():
        if len(places) < 2 or len(places) > DUP_TOO_COMMON:
            continue
        for x in range(len(places)):
            for y in range(x + 1, len(places)):
                (fa, ia), (fb, ib) = places[x], places[y]
                a, b = files[fa], files[fb]
                while ia > 0 and ib > 0 and a[ia - 1][1] == b[ib - 1][1] and \
                        (fa != fb or ia - 1 != ib):
                    ia, ib = ia - 1, ib - 1  # back to the run's first line
                if (fa, ia, fb, ib) in seen:
                    continue
                seen.add((fa, ia, fb, ib))
                n = 0
                while ia + n < len(a) and ib + n < len(b) and a[ia + n][1] == b[ib + n][1] \
                        and (fa != fb or ia + n < ib):
                    n += 1
                if n < DUP_LINES:
                    continue
                yield n, (f"{fa}:{a[ia][0]}-{a[ia + n - 1][0]} ~ "
                          f"{fb}:{b[ib][0]}-{b[ib + n - 1][0]}")


def measure(root: Path) -> Figures:
    src = root / "src" / "stp"
    if not src.is_dir():
        raise ValueError(f"--root {str(root)!r}: no src/stp/ there; give a checkout of stp")
    figs = Figures()
    files: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        scan_file(path, rel, figs)
        files[f"stp/{rel}"] = _significant(path.read_text(encoding="utf-8"))
    figs.duplicates = sorted(_runs(files), key=lambda r: (-r[0], r[1]))
    return figs


def report(figs: Figures, top: int = 8) -> str:
    rows = [
        ("family class tests", "family_class_tests"),
        ("capability probes", "capability_probes"),
        ("Any-typed parameters (job/run/config/spec/stage/family)", "any_parameters"),
        ("files over 400 lines", "long_files"),
        ("train/ modules on one floor", "train_floor_modules"),
        ("duplicate pairs (6+ identical lines)", "duplicates"),
    ]
    out = []
    for title, key in rows:
        items = getattr(figs, key)
        out.append(f"{title}: {len(items)}")
        out.append(f"  counted: {HOW[key]}")
        shown = [f"{n} lines  {w}" for n, w in items] if key == "duplicates" else items
        out += [f"    {s}" for s in shown[:top]]
        if len(shown) > top:
            out.append(f"    ... {len(shown) - top} more")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout to measure (default: this one)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--top", type=int, default=8, help="items listed per figure (default 8)")
    args = ap.parse_args(argv)
    try:
        figs = measure(args.root)
    except ValueError as e:
        print(f"house_metrics: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: len(getattr(figs, k)) for k in HOW} |
                         {"largest_duplicates": [f"{n} lines {w}" for n, w in
                                                 figs.duplicates[:args.top]]}, indent=1))
    else:
        print(report(figs, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
