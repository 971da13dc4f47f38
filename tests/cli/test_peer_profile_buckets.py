"""The profile of the peer benchmark (stp.bench.peer_profile) puts every event's self
time in exactly one bucket: the figures in benchmarks/results/vs_torch.md ("Where
the time goes") are only as right as this sorting."""

from __future__ import annotations

import pytest

from stp.bench.peer import PeerSpec
from stp.bench.peer_profile import BUCKETS, P2P_WAIT, STEP, WORK_WAIT, ProfileSpec, bucket


@pytest.mark.parametrize("name, parents, want", [
    ("aten::mm", (STEP,), "matmul"),
    ("aten::addmm_", ("autograd::engine::evaluate_function: X", STEP), "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", (), "attention"),
    ("## Call CompiledFxGraph fabc ##", ("Torch-Compiled Region: 0/0",), "inductor"),
    ("Torch-Compiled Region: 4/1", (STEP,), "compile glue"),
    ("TorchDynamo Cache Lookup", (STEP,), "compile glue"),
    ("CompiledFunctionBackward", (), "compile glue"),
    ("aten::mul", (STEP,), "other aten"),
    ("autograd::engine::evaluate_function: MmBackward0", (STEP,), "autograd"),
    ("_MLPFn", (STEP,), "autograd"),
    ("c10d::allreduce_", (STEP,), "collective"),
    ("_c10d_functional::wait_tensor", (STEP,), "collective"),
    (WORK_WAIT, ("stp-profile: something", STEP), "collective"),
    (WORK_WAIT, (P2P_WAIT, STEP), "p2p"),  # a pipeline receive's wait, not a collective
    ("c10d::recv_", (STEP,), "p2p"),
    (P2P_WAIT, (STEP,), "p2p"),
    (STEP, (), "rest"),
    ("Optimizer.step#SGD.step", (STEP,), "rest"),
])
def test_each_event_lands_in_its_bucket(name: str, parents: tuple[str, ...], want: str) -> None:
    assert want in BUCKETS
    assert bucket(name, parents) == want


def test_a_profile_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="steps and rounds must be >= 1, got 0, 3"):
        ProfileSpec(PeerSpec(), steps=0)
