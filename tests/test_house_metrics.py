"""scripts/house_metrics.py: it runs on this repository and prints every figure with
how it is counted, and it counts a small planted tree exactly."""

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _metrics():
    spec = importlib.util.spec_from_file_location("house_metrics",
                                                  ROOT / "scripts" / "house_metrics.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_it_runs_on_this_repository_and_says_how_each_figure_is_counted(capsys):
    hm = _metrics()
    assert hm.main([]) == 0
    out = capsys.readouterr().out
    for title in ("family class tests", "capability probes", "Any-typed parameters",
                  "files over 400 lines", "train/ modules on one floor", "duplicate pairs"):
        line = next(x for x in out.splitlines() if x.startswith(title))
        assert int(line.rsplit(": ", 1)[1]) >= 0
    assert out.count("  counted: ") == 6
    assert hm.main(["--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == set(hm.HOW) | {"largest_duplicates"}


PLANTED = {
    "costmodel/memory.py": '''
def price(spec: Any, job: "Any | None", other: Any, run: int) -> None:
    if isinstance(spec, (MoESpec, int)):
        pass
    if type(spec) is MLLMSpec:
        pass
    if isinstance(spec, HardwareSpec):
        pass
    ep = getattr(spec, "ep", 1)
    ok = hasattr(self.stage, "expert_names")
    name = getattr(args, "ep", 1)
    dyn = getattr(spec, key)
''',
    "costmodel/moe_costs.py": '''
def moe(spec):
    return isinstance(spec, MoESpec) and getattr(spec, "ep", 1)
''',
    "models/moe/stage.py": '''
def build(config: Any) -> None:
    return isinstance(config, MoEConfig)
''',
    "train/run.py": "x = 1\n" * 401,
    "train/__init__.py": "",
    "train/step/a.py": "",
}
"""Counted: memory.py's isinstance MoESpec and type() is MLLMSpec (2 family class
tests), getattr(spec, 'ep') and hasattr(self.stage, ...) (2 probes); spec, job and
the MoE builder's config are Any-typed names (3); run.py is long (1); run.py and
__init__.py stand on train/'s floor (2). Not counted: HardwareSpec, args, a
variable name, `other`, `run: int`, anything in the MoE family's own files
(costmodel/moe_costs.py, models/moe/)."""


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "src" / "stp" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_it_counts_a_planted_tree_exactly(tmp_path):
    hm = _metrics()
    _plant(tmp_path, PLANTED)
    figs = hm.measure(tmp_path)
    assert [x.split(" ", 1)[0] for x in figs.family_class_tests] == [
        "stp/costmodel/memory.py:3", "stp/costmodel/memory.py:5"]
    assert [x.split(" ", 1)[1] for x in figs.capability_probes] == [
        "getattr 'ep'", "hasattr 'expert_names'"]
    assert sorted(x.split(" ", 1)[1] for x in figs.any_parameters) == [
        "build(config)", "price(job)", "price(spec)"]
    assert figs.long_files == ["train/run.py 401"]
    assert sorted(figs.train_floor_modules) == ["train/__init__.py", "train/run.py"]
    assert figs.duplicates == []


def test_it_finds_a_planted_duplicate_and_not_a_short_one(tmp_path):
    hm = _metrics()
    body = "".join(f"    total += value_{i} * {i}\n" for i in range(7))
    _plant(tmp_path, {
        "sim/a.py": "def f():\n    total = 0\n" + body + "    return total\n",
        "viz/b.py": "# a comment\n\ndef g():\n    total = 1\n" + body + "    return -total\n",
        "plan/c.py": "def h():\n" + body.replace("value_6", "other"),
    })
    figs = hm.measure(tmp_path)
    assert figs.duplicates == [(7, "stp/sim/a.py:3-9 ~ stp/viz/b.py:5-11"),
                               (6, "stp/plan/c.py:2-7 ~ stp/sim/a.py:3-8"),
                               (6, "stp/plan/c.py:2-7 ~ stp/viz/b.py:5-10")]


def test_a_root_without_stp_is_one_clear_line(tmp_path, capsys):
    hm = _metrics()
    assert hm.main(["--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("house_metrics: --root ") and "no src/stp/" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text,expected", [("Any", True), ("Any | None", True),
                                           ("int", False), ("Any | int", False)])
def test_any_annotations(text, expected):
    import ast
    hm = _metrics()
    assert hm._is_any(ast.parse(text, mode="eval").body) is expected
