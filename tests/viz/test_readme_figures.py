"""The README's pictures are what scripts/make_readme_figures.py writes today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_svgs_match_the_script(tmp_path):
    spec = importlib.util.spec_from_file_location("figs", ROOT / "scripts/make_readme_figures.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--out-dir", str(tmp_path), "--no-png"])
    for svg in sorted(tmp_path.glob("*.svg")):
        committed = ROOT / "docs" / svg.name
        assert committed.exists(), f"run scripts/make_readme_figures.py: {committed} missing"
        assert committed.read_text() == svg.read_text(), (
            f"{committed.name} is stale: run python scripts/make_readme_figures.py"
        )
    assert (ROOT / "docs/stp_p4_m12.png").exists()
