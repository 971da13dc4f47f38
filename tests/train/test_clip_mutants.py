"""stp.train.step.clip in one process, against torch.nn.utils.clip_grad_norm_ and hand counts.

Written to kill mutants mutmut left alive in stp/train/step/clip.py (docs/testing.md):
the parity tests of tests/train/test_clip_parity.py run the trainer in spawned
workers, where mutmut cannot see which tests reach which function, and they
clip only with the norm above the limit. Each test names the bug it guards
against.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stp.train.step.clip import clip_coefficient, counted_mask, grad_norm, scale_grads


def _torch_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """torch's own clipping of copies of `grads`: (norm, clipped gradients)."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    return float(norm), [p.grad for p in params]


def _grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 3, generator=gen, dtype=torch.float64),
            torch.randn(5, generator=gen, dtype=torch.float64)]


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clipping_below_and_above_the_limit_is_torchs_bit_for_bit(max_norm: float) -> None:
    """Kills: a changed coefficient (max instead of min, 1.0 replaced, the 1e-6 guard
    changed or added to max_norm instead of the norm), and a scale that skips or
    changes any gradient. float64, so torch's coefficient is the same float."""
    grads = _grads()
    ref_norm, ref_grads = _torch_clip(grads, max_norm)
    norm = grad_norm(grads, [True, True], None)
    assert norm == pytest.approx(ref_norm, rel=1e-15)
    factor = clip_coefficient(ref_norm, max_norm)
    scale_grads(grads, factor)
    assert (factor < 1.0) == (max_norm < ref_norm)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        assert torch.equal(mine, theirs)


def test_the_coefficient_at_a_zero_and_a_tiny_norm() -> None:
    """Kills: a changed EPS (1e-6 is torch's guard) and a coefficient without min(1, .)."""
    assert clip_coefficient(0.0, 1.0) == 1.0
    assert clip_coefficient(1e-6, 1e-6) == pytest.approx(0.5, rel=1e-12)  # 1e-6 / (1e-6 + 1e-6)
    assert clip_coefficient(3.0, 1.0) == pytest.approx(1 / (3.0 + 1e-6), rel=1e-15)


def test_a_tied_embedding_and_head_on_one_rank_is_counted_once() -> None:
    """Kills: a mask that counts a key seen twice on the same rank (pp 1 holds the
    tied embedding and head; both report the same key) and one that drops the first."""
    grads = _grads()
    tied = grads[0]
    mask = counted_mask(["embed", "gain", "embed"], rank=0)
    assert mask == [True, True, False]
    ref_norm, _ = _torch_clip(grads, 1.0)
    assert grad_norm([tied, grads[1], tied], mask, None) == pytest.approx(ref_norm, rel=1e-15)


def test_the_lowest_global_rank_holding_a_key_counts_it(monkeypatch) -> None:
    """Kills: owner chosen by max instead of min, the world's keys not gathered, and the
    owner's default changed. Hand count over three ranks: x on 0 and 1, y on 1 and 2."""
    held = {0: ["x"], 1: ["x", "y"], 2: ["y", "z"]}
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)

    def gather(out: list[object], mine: object) -> None:
        """all_gather_object: fills a list of world-size slots with every rank's object."""
        assert out == [None, None, None]
        rank, keys = mine  # type: ignore[misc]
        assert keys == held[rank]
        for r in range(3):
            out[r] = (r, held[r])

    masks = {r: counted_mask(keys, rank=r, gather=gather) for r, keys in held.items()}
    assert masks == {0: [True], 1: [False, True], 2: [False, True]}


def test_the_world_sum_adds_squares_in_float64() -> None:
    """Kills: the world sum applied after the square root or to a copy, and the local
    sum squared or taken in the gradients' dtype. Other ranks' squares: 9.0; a float16
    gradient of norm 1000 whose square (1e6) is past float16's 65504."""
    g = torch.full((4,), 500.0, dtype=torch.float16)  # norm 1000

    def world_sum(total: torch.Tensor) -> None:
        assert total.dtype == torch.float64 and total.dim() == 0
        total.add_(9.0)

    assert grad_norm([g], [True], world_sum) == pytest.approx((1000.0**2 + 9.0) ** 0.5, rel=1e-12)
    assert grad_norm([g], [False], world_sum) == 3.0
    assert grad_norm([], [], world_sum) == 3.0
    assert grad_norm([], [], None) == 0.0


def test_only_the_counted_gradients_enter_the_norm() -> None:
    """Kills: a mask ignored or inverted in grad_norm."""
    a = torch.tensor([3.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.0, 4.0], dtype=torch.float64)
    assert grad_norm([a, b], [True, True], None) == 5.0
    assert grad_norm([a, b], [True, False], None) == 3.0
    assert grad_norm([a, b], [False, True], None) == 4.0


def test_gradients_and_their_marks_must_pair_up() -> None:
    """Kills: zip without strict=True (a mask shorter than the gradients would
    silently leave the last ones out of the norm)."""
    g = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ValueError):
        grad_norm([g, g], [True], None)


class _Reduced(Exception):
    """Raised by the fake world sum once it has seen the scalar."""


def test_the_summed_scalar_lives_on_the_gradients_device() -> None:
    """Kills: the float64 scalar made on the default device (CPU) instead of the
    gradients' (NCCL all-reduces only CUDA tensors, also on a rank that counts no
    gradient). The meta device stands in for CUDA on a CPU-only machine."""
    g = torch.empty(3, device="meta")

    def world_sum(total: torch.Tensor) -> None:
        assert total.device == g.device
        raise _Reduced

    for counted in ([False], [True]):
        with pytest.raises(_Reduced):
            grad_norm([g], counted, world_sum)
