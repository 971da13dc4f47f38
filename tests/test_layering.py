"""Layers point one way (docs/architecture.md lists the allowed arrows).

Two checks: the pure layers import without torch (torch made unimportable in
a fresh interpreter), and every import statement in the package, those
inside functions included, goes only where the layer table allows.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CODE = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
import importlib, pkgutil
import stp.schedule, stp.sim
mods = ['stp.schedule', 'stp.sim']
try:
    import stp.viz
    mods.append('stp.viz')
except ModuleNotFoundError as e:
    if e.name != 'stp.viz':
        raise
for pkg in mods:
    p = importlib.import_module(pkg)
    for m in pkgutil.walk_packages(p.__path__, pkg + '.'):
        importlib.import_module(m.name)
import stp.cli.main
stp.cli.main.build_parser()
print('ok')
"""

SRC = Path(__file__).resolve().parents[1] / "src" / "stp"

# Each layer and the stp layers (and torch) it may import; docs/architecture.md.
# `stp.files` (atomic writes, standard library only) may be used by every layer.
PURE = {"schedule", "sim", "viz", "search", "costmodel"}
UTIL = {"files"}
ALLOWED: dict[str, set[str]] = {
    "schedule": {"schedule"},
    "sim": {"schedule", "sim"},
    "viz": {"schedule", "sim", "viz"},
    "costmodel": {"schedule", "sim", "costmodel"},
    "search": {"schedule", "sim", "search", "costmodel"},
    "runtime": {"schedule", "sim", "viz", "runtime", "torch"},
    "models": {"schedule", "sim", "runtime", "models", "torch"},
    "train": PURE | {"runtime", "models", "train", "torch"},
    "bench": PURE | {"runtime", "models", "train", "bench", "torch"},
    "cli": PURE | {"runtime", "models", "train", "bench", "cli", "torch"},
}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "torch":
        return "torch"
    if parts[0] == "stp" and len(parts) > 1:
        return parts[1]
    return None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, inside functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if len(rel.parts) < 2 or rel.parts[0] not in ALLOWED:
            continue  # stp/__init__.py and top-level modules
        layer = rel.parts[0]
        for line, module in _imports(path):
            target = _layer_of(module)
            if target is not None and target not in ALLOWED[layer] | UTIL:
                bad.append(f"stp/{rel}:{line}: {layer} imports {module}")
    return bad


def test_pure_layers_import_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_import_follows_the_layer_table():
    assert _violations() == []


def test_every_package_has_a_row():
    """A new package must be placed in the table (and in docs/architecture.md)."""
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("layer,forbidden", [
    ("runtime", "stp.models.stage"), ("runtime", "stp.train.trainer"),
    ("runtime", "stp.cli.main"), ("schedule", "torch"), ("sim", "torch.nn"),
    ("models", "stp.train.job"), ("train", "stp.bench.peer"),
])
def test_the_check_sees_a_forbidden_import(layer, forbidden):
    """Negative control: the table refuses the arrows the issue names."""
    assert _layer_of(forbidden) not in ALLOWED[layer]
