"""tests/train reuses the multi-process helpers of tests/runtime (_dist, _parity)."""

import sys
from pathlib import Path

import pytest

RUNTIME_TESTS = str(Path(__file__).resolve().parents[1] / "runtime")
if RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, RUNTIME_TESTS)


@pytest.fixture
def one_torch_thread():
    """In-process world-of-one Trainers on one intra-op thread, as run_dist's workers run:
    their tensors are tiny, and a second thread only adds synchronisation, which on a
    busy machine costs ten times the arithmetic. The world is initialised first
    (stp.runtime.launch.init_distributed would set the thread count itself)."""
    import torch

    from stp.runtime.launch import init_distributed

    init_distributed(timeout=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
