"""`stp train`'s files: outputs checked before any work, run directories that never
collide, and data read in pieces (a rank's memory does not grow with --data)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stp.cli.main import main
from stp.train.run.config import TrainJob, new_run_dir

TINY = ["--schedule", "1f1b", "--pp", "2", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--seq-len", "16", "--microbatch-size", "1", "-m", "2", "--steps", "2"]


@pytest.mark.parametrize("trace,message", [
    ("/proc/stp-trace.json", "--trace '/proc/stp-trace.json': cannot write in '/proc'"),
    ("/nonexistent/t.json", "--trace '/nonexistent/t.json': directory '/nonexistent' does not"),
    ("{tmp}", "is a directory; give a file name"),
])
def test_unwritable_trace_is_refused_before_any_worker(capsys, tmp_path, trace, message) -> None:
    """It used to fail only after training, losing the run."""
    start = time.monotonic()
    out = tmp_path / "out"
    code = main(["train", *TINY, "--trace", trace.format(tmp=tmp_path), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert time.monotonic() - start < 20 and not out.exists()


def test_run_directories_are_unique(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    first, second = TrainJob().out_dir(), TrainJob().out_dir()  # the same second, likely
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == second.parent == Path("runs")
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(new_run_dir(tmp_path, "train-x")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in got) == ["train-x"] + [f"train-x-{n}" for n in range(2, 9)]
    with pytest.raises(ValueError, match="cannot create a run directory in '/proc'"):
        new_run_dir(Path("/proc"), "train-x")


MEASURE = """
import resource, sys
import torch
from stp.train.run.config import TrainJob
from stp.train.data.corpus import ByteBatches, open_corpus, read_corpus
from stp.train.run.job import check

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

before = peak_mib()
check(TrainJob(pp=1, data=sys.argv[1]))  # sizes only
corpus = open_corpus(sys.argv[1])
batches = ByteBatches(corpus, 64, 256, seed=0)
for step in range(20):
    tokens, _ = batches.batch(step)
head = read_corpus(sys.argv[1])  # capped
print(corpus.size, len(head), round(peak_mib() - before))
"""


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(b"def f(x):\n    return x\n" * 64)
        f.truncate(size)  # a hole: no disk space, reads as zeros
    return path


def test_data_is_read_in_pieces(tmp_path) -> None:
    """A 1 GiB --data file used to be read whole into every rank (1.28 GB resident)."""
    big = _sparse(tmp_path / "big.txt", 1 << 30)
    out = subprocess.run([sys.executable, "-c", MEASURE, str(big)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    size, head, grown_mib = (int(x) for x in out.stdout.split())
    assert size == 1 << 30 and head == 4 << 20
    assert grown_mib < 48, grown_mib


PEAK_OF_CHILD = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(code, round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024))
"""


def test_training_on_a_large_file_stays_small(tmp_path) -> None:
    big = _sparse(tmp_path / "big.txt", 1 << 30)
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *TINY, "--pp", "1", "--data", str(big),
           "--out", str(tmp_path / "out")]
    out = subprocess.run([sys.executable, "-c", PEAK_OF_CHILD, *cmd], capture_output=True,
                         text=True, timeout=180)
    code, peak_mib = (int(x) for x in out.stdout.split())
    assert code == 0, out.stderr
    assert peak_mib < 700, peak_mib  # torch and the model; the file would add 1024
