"""The pure layers (schedule, sim, viz) must import without torch (STYLE.md rule 2)."""

import subprocess
import sys

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


def test_pure_layers_import_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
