"""Reads of a tensor's value into Python or host memory, counted as they happen.

A training step that reads a device tensor on the host (`.item()`, `.tolist()`,
`float(t)`, `.cpu()`, ...) waits for the device there. `HostReads`, a
TorchFunctionMode, records the name of each such read while it is active, except
reads of tensors sharing storage with the tensors it is given (the caller's own
host batch, which stays on the host on every machine). Used by the step-count
benchmark (`benchmarks/step_counts.py`) and the test that a step reads its
figures once (`tests/train/test_host_syncs.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["READS", "HostReads"]

READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}
"""The tensor methods that hand a value to the host."""


class HostReads(TorchFunctionMode):
    """Records the name of every read of a tensor's value into Python or host memory,
    except of tensors sharing storage with `host` (the caller's batch)."""

    def __init__(self, host: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.host = {t.untyped_storage().data_ptr() for t in host}
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if (name in READS and args and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage().data_ptr() not in self.host):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
