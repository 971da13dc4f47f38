"""Stage one module's mutation run for scripts/mutation.sh (docs/testing.md).

mutmut 3 reads its settings from ./pyproject.toml only and keeps its state in
./mutants/, so one module's run gets a directory of its own, .mutation/MODULE/,
holding a copy of src/ (mutmut mutates that copy, never the checkout), a link
to tests/, and a pyproject.toml that is the project's with [tool.mutmut]
narrowed to the module: only_mutate and the test selection come from the
project's [tool.stp-mutation.MODULE] table.

    python scripts/mutation_stage.py stage ROOT MODULE   # prints the stage directory
    python scripts/mutation_stage.py score STATS.json    # prints one line: the score
"""

from __future__ import annotations

import json
import shutil
import sys
import tomllib
from pathlib import Path


def modules(root: Path) -> dict[str, dict[str, list[str]]]:
    """The [tool.stp-mutation.*] tables of ROOT/pyproject.toml."""
    data = tomllib.loads((root / "pyproject.toml").read_text("utf-8"))
    return data["tool"]["stp-mutation"]


def without_table(text: str, header: str) -> str:
    """TEXT without the TOML table that starts at line HEADER (up to the next header)."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if line.startswith("["):
            skipping = line.strip() == header
        if not skipping:
            out.append(line)
    return "".join(out)


def mutmut_table(shared: dict[str, object], module: dict[str, list[str]]) -> str:
    """[tool.mutmut] of one module: the shared settings, with this module's files and tests.
    JSON's strings, numbers, booleans and lists of them are valid TOML values."""
    settings = dict(shared)
    settings["only_mutate"] = module["mutate"]
    settings["pytest_add_cli_args_test_selection"] = module["tests"]
    lines = ["[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def stage(root: Path, name: str) -> Path:
    """Make (or refresh) .mutation/NAME/ and return it. Exit 2 on an unknown module."""
    known = modules(root)
    if name not in known:
        print(f"scripts/mutation.sh: unknown module {name!r}; accepted: {', '.join(known)}",
              file=sys.stderr)
        raise SystemExit(2)
    where = root / ".mutation" / name
    where.mkdir(parents=True, exist_ok=True)
    # copy2 keeps modification times: mutmut re-mutates (and forgets the results of)
    # only the files whose source is newer than their mutated copy
    shutil.copytree(root / "src", where / "src", copy_function=shutil.copy2,
                    dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    tests = where / "tests"
    if not tests.is_symlink():
        tests.symlink_to(root / "tests", target_is_directory=True)
    text = (root / "pyproject.toml").read_text("utf-8")
    shared = tomllib.loads(text)["tool"]["mutmut"]
    body = without_table(text, "[tool.mutmut]")
    table = mutmut_table(shared, known[name])
    (where / "pyproject.toml").write_text(body.rstrip("\n") + "\n\n" + table, "utf-8")
    return where


def score(stats_path: Path) -> str:
    """One line from mutmut's export-cicd-stats: killed / (every mutant mutmut ran)."""
    stats = json.loads(stats_path.read_text("utf-8"))
    killed = int(stats.get("killed", 0)) + int(stats.get("timeout", 0))
    judged = int(stats.get("total", 0)) - int(stats.get("skipped", 0))
    percent = 100.0 * killed / judged if judged else 0.0
    detail = ", ".join(f"{k} {v}" for k, v in sorted(stats.items()) if k != "total")
    return f"score {percent:.1f}% ({killed} of {judged} killed; {detail})"


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "stage":
        print(stage(Path(argv[1]).resolve(), argv[2]))
    elif len(argv) == 2 and argv[0] == "score":
        print(score(Path(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
