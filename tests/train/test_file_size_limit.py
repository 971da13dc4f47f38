"""A file-size limit (`ulimit -f`, EFBIG) met while saving is named as such, in one
line, as a full disk is: torch's zip writer reported it as `unexpected pos 704 vs 598`,
which says nothing about the cause."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from stp.train.checkpoint import storage

SHORT = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_a_short_write_under_a_file_size_limit_names_the_limit(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda what: (150 * 1024, resource.RLIM_INFINITY))
    line = str(storage.save_failure(SHORT, tmp_path / ".step-1.partial", tmp_path / "step-1", 0))
    assert "file too large (EFBIG)" in line and "ulimit -f" in line and "0.1 MiB" in line
    assert "unexpected pos" not in line


def test_a_short_write_on_a_full_device_says_so(tmp_path, monkeypatch) -> None:
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(resource, "getrlimit",
                        lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10, 10))
    line = str(storage.save_failure(SHORT, tmp_path / ".p", tmp_path / "step-1", 0))
    assert "no space left on device" in line


def _limited(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


@pytest.mark.parametrize("mesh", [["--pp", "1"], ["--pp", "2", "--layers", "4"]],
                         ids=["pp1", "pp2"])
def test_stp_train_under_ulimit_f_is_one_line(tmp_path: Path, mesh: list[str]) -> None:
    """End to end: a limit the checkpoint's shard crosses (150 KiB for the default model).
    At pp 2 every rank meets the same fault: rank 0 says it once (it was printed by every
    rank, then the launcher added "rank 0 exited with status 1")."""
    out = tmp_path / "out"
    got = subprocess.run(
        [sys.executable, "-m", "stp.cli.main", "train", *mesh, "--steps", "1", "--out",
         str(out)], capture_output=True, text=True, timeout=300, preexec_fn=_limited(150 * 1024),
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [ln for ln in got.stderr.splitlines() if ln.startswith("stp: error")]
    assert got.returncode != 0 and len(errors) == 1, got.stderr[-2000:]
    assert "file too large (EFBIG)" in errors[0] and "Traceback" not in got.stderr, errors
