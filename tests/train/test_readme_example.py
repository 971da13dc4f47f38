"""The README's Python examples run as written: the two code blocks under
"Training from Python", taken from README.md itself, each under a 2-process
torchrun (the Trainer initialises torch.distributed from its environment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    text = README.read_text()
    section = text.split("## Training from Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _torchrun(script: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", script.name]
    return subprocess.run(cmd, cwd=script.parent, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_readme_training_and_resume_examples_run_as_written(tmp_path: Path) -> None:
    blocks = python_blocks()
    assert len(blocks) == 2, "README: a training example and a resume example"
    train, resume = tmp_path / "train.py", tmp_path / "resume.py"
    train.write_text(blocks[0])
    resume.write_text(blocks[1])
    first = _torchrun(train)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["5", "10", "15", "20"], first.stdout
    losses = [float(ln.split()[3]) for ln in lines]
    assert losses[-1] < losses[0]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000015", "step-00000020"]  # keep=2
    second = _torchrun(resume)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step-00000030").is_dir()
