"""Layers point one way (docs/architecture.md lists the allowed arrows).

Four checks: the pure layers import without torch (torch made unimportable in
a fresh interpreter); every import statement in the package, those inside
functions included, goes only where the layer table allows; no module imports
itself back through others (no circles, imports inside functions counted);
and above the model families nothing tells one family from another by its
classes (stp.models.family is the seam).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

CODE = """
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
import importlib, pkgutil
import stp.schedule, stp.sim, stp.shapes
mods = ['stp.schedule', 'stp.sim', 'stp.shapes', 'stp.costmodel', 'stp.search', 'stp.plan']
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
# `stp.files` (atomic writes) and `stp.shapes` (the model families' configs), both
# standard library only, may be used by every layer.
PURE = {"schedule", "sim", "viz", "search", "costmodel", "plan"}
UTIL = {"files", "shapes"}
ALLOWED: dict[str, set[str]] = {
    "shapes": {"shapes"},
    "schedule": {"schedule"},
    "sim": {"schedule", "sim"},
    "viz": {"schedule", "sim", "viz"},
    "costmodel": {"schedule", "sim", "costmodel"},
    "search": {"schedule", "sim", "search", "costmodel"},
    "plan": {"schedule", "sim", "search", "costmodel", "plan"},
    "runtime": {"schedule", "sim", "runtime", "torch"},
    "models": {"schedule", "sim", "costmodel", "runtime", "models", "torch"},
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """stp module -> the stp modules it imports (inside functions too); `from pkg
    import name` counts as importing `pkg.name` when that is a module."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names}
    return {m: {t for t in ts if t in modules and t != m} for m, ts in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circles():
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_sees_a_circle():
    """Negative control: the job <-> plan circle the restructure removed."""
    graph = {"stp.train.run.job": {"stp.train.plan"}, "stp.train.plan": {"stp.train.run.job"},
             "stp.train.run.loop": {"stp.train.run.job"}}
    assert _cycles(graph) == [["stp.train.plan", "stp.train.run.job"]]


# The concrete classes of the model families: only a family's own modules (under
# stp.models, stp.shapes, stp.costmodel and the registry stp.train.families) may
# name them to tell one family from another.
FAMILY_CLASSES = {"ModelConfig", "MLLMConfig", "ModelSpec", "MLLMSpec", "ModelStage",
                  "MLLMStage", "VisionConfig"}
ABOVE_FAMILIES = ("train", "cli", "runtime", "bench")


def _family_forks(path: Path) -> list[str]:
    """`isinstance(x, <family class>)` and `arch ==`/`!=` comparisons in a file."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            kinds = node.args[1] if len(node.args) > 1 else None
            names = {getattr(k, "id", getattr(k, "attr", None)) for k in
                     (kinds.elts if isinstance(kinds, ast.Tuple) else [kinds])}
            if names & FAMILY_CLASSES:
                bad.append(f"{path.name}:{node.lineno}: isinstance on {names & FAMILY_CLASSES}")
        if isinstance(node, ast.Compare) and any(isinstance(o, ast.Eq | ast.NotEq)
                                                 for o in node.ops):
            sides = [node.left, *node.comparators]
            if any(getattr(x, "attr", getattr(x, "id", None)) == "arch" for x in sides):
                bad.append(f"{path.name}:{node.lineno}: compares arch")
    return bad


def test_no_family_forks_above_the_models():
    bad = []
    for layer in ABOVE_FAMILIES:
        for path in sorted((SRC / layer).rglob("*.py")):
            if path.parent.name != "families":  # the registry and the job halves
                bad += _family_forks(path)
    assert bad == []


def test_the_fork_check_sees_a_fork(tmp_path):
    """Negative control: the two forms the family seam replaced."""
    src = tmp_path / "fork.py"
    src.write_text("if isinstance(model, (MLLMConfig, int)):\n    pass\n"
                   "if job.arch == 'mllm':\n    pass\n")
    assert len(_family_forks(src)) == 2


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
    ("runtime", "stp.models.decoder.stage"), ("runtime", "stp.train.step.trainer"),
    ("runtime", "stp.cli.main"), ("schedule", "torch"), ("sim", "torch.nn"),
    ("models", "stp.train.run.job"), ("train", "stp.bench.peer"),
])
def test_the_check_sees_a_forbidden_import(layer, forbidden):
    """Negative control: the table refuses the arrows the issue names."""
    assert _layer_of(forbidden) not in ALLOWED[layer]


# The family seam on the pricing side: the shared cost model, the planner and the
# CLI ask a family's row (stp.costmodel.families) or its spec's methods; only a
# family's own package may test its classes or probe for what it has.
SEAM_SCANNED = ["costmodel", "plan", "cli", "train/run/memory_check.py"]
"""Packages and files (under src/stp) held to the seam; other checks may add theirs."""
PROBED_NAMES = re.compile(r"^(?:\w+_)?(?:stage|spec|config|cfg|job|family|model|decoder)s?$")
"""What a probed object is called: a stage, spec, config, job or family (argparse
namespaces, exceptions and records are not concerned)."""


def _family_packages() -> set[Path]:
    """Each family's own packages: stp.models.<family> and stp.costmodel.<family>."""
    return {p for base in ("models", "costmodel") for p in (SRC / base).iterdir()
            if (p / "__init__.py").exists()}


def _family_class_names() -> set[str]:
    """The classes of the families' configs (stp.shapes), cost specs and stages."""
    files = [*(SRC / "shapes").glob("*.py"),
             *(p / "spec.py" for p in _family_packages() if p.parent.name == "costmodel"),
             *(f for p in _family_packages() if p.parent.name == "models"
               for f in p.glob("stage*.py"))]
    return {node.name for f in files if f.exists()
            for node in ast.walk(ast.parse(f.read_text(), str(f)))
            if isinstance(node, ast.ClassDef)}


def _name_of(node: ast.AST) -> str | None:
    return getattr(node, "id", getattr(node, "attr", None))


def _class_names_in(node: ast.AST) -> set[str]:
    """The names a class argument spells: `A`, `m.A`, `(A, B)`, `A | B`."""
    if isinstance(node, ast.Tuple):
        return set().union(*(_class_names_in(e) for e in node.elts))
    if isinstance(node, ast.BinOp):
        return _class_names_in(node.left) | _class_names_in(node.right)
    name = _name_of(node)
    return {name} if name else set()


def _seam_breaks(path: Path, classes: set[str]) -> list[str]:
    """Class tests on `classes` (isinstance, issubclass, `type(x) is/==/in`) and
    capability probes (getattr/hasattr of a constant name on a stage, spec, config,
    job or family) in one file."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and _name_of(node.func) in ("isinstance", "issubclass"):
            hit = _class_names_in(node.args[1]) & classes if len(node.args) > 1 else set()
            if hit:
                bad.append(f"{path}:{node.lineno}: {_name_of(node.func)} on {sorted(hit)}")
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                and _name_of(node.left.func) == "type":
            hit = set().union(*(_class_names_in(c) for c in node.comparators)) & classes
            if hit:
                bad.append(f"{path}:{node.lineno}: type() compared with {sorted(hit)}")
        elif isinstance(node, ast.Call) and _name_of(node.func) in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) \
                and PROBED_NAMES.match(_name_of(node.args[0]) or ""):
            bad.append(f"{path}:{node.lineno}: probes {_name_of(node.args[0])} for "
                       f"{node.args[1].value!r}")
    return bad


def _seam_files(scanned: list[str]) -> list[Path]:
    """The .py files of `scanned`, less those inside a family's own package."""
    own = _family_packages()
    out = []
    for entry in scanned:
        target = SRC / entry
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            if not any(pkg in path.parents for pkg in own):
                out.append(path)
    return out


def test_the_pricing_side_asks_the_families():
    classes = _family_class_names()
    files = _seam_files(SEAM_SCANNED)
    assert len(files) > 20 and {"ModelSpec", "MoESpec", "MLLMConfig", "MoEStage"} <= classes
    assert [b for f in files for b in _seam_breaks(f, classes)] == []


def test_the_seam_check_sees_a_class_test_and_a_probe(tmp_path):
    """Negative control: the forms the pricing side's seam replaced."""
    src = tmp_path / "fork.py"
    src.write_text("ep = spec.ep if isinstance(spec, MoESpec) else 1\n"
                   "if isinstance(model, (int, mllm.MLLMSpec)):\n    pass\n"
                   "if type(run.config) is MLLMConfig:\n    pass\n"
                   "ep = getattr(job, 'ep', 1)\n"
                   "moe = hasattr(run.config, 'num_experts')\n"
                   "flag = getattr(args, 'ep', None)\n"  # argparse: not concerned
                   "ok = isinstance(value, int)\n")
    bad = _seam_breaks(src, _family_class_names())
    assert len(bad) == 5, bad


def test_the_seam_skips_only_the_families_own_packages():
    files = _seam_files(["costmodel"])
    assert SRC / "costmodel" / "memory.py" in files
    assert not any("decoder" in f.relative_to(SRC).parts for f in files)


# What a stage or a family may offer is its contract's (stp.runtime.stage_api,
# stp.models.family, with the defaults): asking an object for a member by name is
# a capability probe, left only to the contracts themselves and to a family's own
# package. A probe's receiver is known by its name.
PROBED = {"stage", "st", "stages", "spec", "config", "cfg", "job", "run", "family", "model"}
CONTRACTS = {"runtime/stage_api.py", "models/family.py"}
FAMILY_PACKAGES = ("models/decoder/", "models/moe/", "models/mllm/", "train/families/")
TORCH_SIDE = ("train", "runtime", "models", "bench", "cli")


def _receiver(node: ast.expr) -> str | None:
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _probes(path: Path) -> list[str]:
    """`getattr(x, "name", ...)` and `hasattr(x, "name")` on a stage, spec, config,
    job or family."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and _receiver(node.args[0]) in PROBED):
            bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_capability_probe_outside_the_contracts():
    bad = []
    for layer in TORCH_SIDE:
        for path in sorted((SRC / layer).rglob("*.py")):
            rel = path.relative_to(SRC).as_posix()
            if rel in CONTRACTS or rel.startswith(FAMILY_PACKAGES):
                continue
            bad += _probes(path)
    assert bad == []


def test_the_probe_check_sees_a_probe(tmp_path):
    """Negative control: the probes the contracts replaced, and two it leaves alone
    (a namespace of parsed flags, a name that is not constant)."""
    src = tmp_path / "probe.py"
    src.write_text('check = getattr(run.family.model, "check_ep", None)\n'
                   'if hasattr(st, "take_aux"):\n    pass\n'
                   'names = getattr(stages[s], "expert_names", ())\n'
                   'chunks = getattr(args, "chunks", None)\n'
                   'value = getattr(job, field.name)\n')
    assert [line.split(":")[1] for line in _probes(src)] == ["1", "2", "4"]


def _format_imports(path: Path) -> list[str]:
    """Imports of the Hugging Face checkpoint format (stp.models.hf) in a file."""
    return [f"{path.name}:{line}: {module}" for line, module in _imports(path)
            if module == "stp.models.hf" or module.startswith("stp.models.hf.")]


def test_the_checkpoint_format_sits_above_the_families():
    """stp.models.hf reads the families' parameter specs; a family never imports it."""
    bad = []
    for package in ("decoder", "moe", "mllm"):
        for path in sorted((SRC / "models" / package).rglob("*.py")):
            bad += _format_imports(path)
    assert bad == []


def test_the_format_check_sees_an_import(tmp_path):
    """Negative control: the import the families had."""
    src = tmp_path / "family.py"
    src.write_text("from stp.models.hf.save import save_stages\nimport stp.models.hformat\n")
    assert [b.split(": ")[1] for b in _format_imports(src)] == ["stp.models.hf.save"]
