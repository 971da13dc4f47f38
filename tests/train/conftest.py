"""tests/train reuses the multi-process helpers of tests/runtime (_dist, _parity)."""

import sys
from pathlib import Path

RUNTIME_TESTS = str(Path(__file__).resolve().parents[1] / "runtime")
if RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, RUNTIME_TESTS)
