"""Activation offload on the schedules PyTorch ships that stp added, in one
process (pp = 1, as tests/runtime/test_offload_runtime.py): every policy
gives bit-identical losses and gradients, braided (DualPipeV's pairs unit by
unit) or not, with poisoned released storages, and nothing stays resident."""

from __future__ import annotations

import pytest
from test_offload_runtime import M, _base, _run, _same

from stp.runtime.offload import runtime_plan
from stp.schedule.registry import make as make_schedule


@pytest.mark.parametrize(("name", "mode"), [
    ("dualpipev", "poison"), ("dualpipev", "unbraided"),
    ("looped-bfs", "poison"), ("zb-interleaved", "poison"),
])
def test_every_policy_is_bit_identical(name: str, mode: str) -> None:
    braid = mode != "unbraided"
    for policy in ("none", "stp", "all", "selective:0.3"):
        got = _run(name, policy, braid, poison=mode == "poison")
        assert _same(got, _base(name, braid)), (name, policy)
        off = got[2]
        assert off is not None and off.resident_bytes() == 0 == off.recount()
        planned = len(runtime_plan(make_schedule(name, 1, M), policy))
        assert (off.memory.offloaded_bytes > 0) == (planned > 0), (name, policy)
    assert len(runtime_plan(make_schedule(name, 1, M), "all")) > 0
