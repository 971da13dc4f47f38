"""Mixtures (`--data 0.7:A,0.3:B`, stp.train.data.mixture) and the prefetch thread
(stp.train.data.prefetch): realised proportions near the weights, batches a pure
function of (seed, step), a source that runs out starting its next epoch, and
prefetched batches equal to the ones built on demand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stp.train.data.load import DataOptions, open_data
from stp.train.data.mixture import BLOCK, block_shares
from stp.train.data.prefetch import Prefetched

SEQ, BATCH = 7, 8


def _source(path: Path, low: int, tokens: int) -> str:
    """A flat token file whose ids all lie in [low, low + 40): a row names its source."""
    rng = np.random.default_rng(low)
    path.write_bytes(rng.integers(low, low + 40, tokens, dtype=np.uint16).tobytes())
    return str(path)


@pytest.fixture
def two(tmp_path) -> tuple[str, str]:
    return _source(tmp_path / "a.bin", 0, 4000), _source(tmp_path / "b.bin", 100, 800)


def _mix(a: str, b: str, wa: float, seed: int = 0):
    return open_data(DataOptions(f"{wa}:{a},{1 - wa}:{b}"), None, 256, SEQ, BATCH, seed)


@pytest.mark.parametrize("wa", [0.7, 0.2, 0.5])
def test_realised_proportions_over_200_batches_are_within_5_percent_of_the_weights(two, wa):
    opened = _mix(*two, wa)
    from_a = rows = 0
    for step in range(200):
        tokens, _ = opened.batches.batch(step)
        from_a += int((tokens[:, 0] < 100).sum())
        rows += tokens.shape[0]
    assert abs(from_a / rows - wa) <= 0.05 * wa, (from_a / rows, wa)
    assert "mixture of" in opened.line() and f"{wa:.3g} x tokens" in opened.line()


def test_batches_are_a_pure_function_of_seed_and_step(two):
    first = [_mix(*two, 0.7).batches.batch(s)[0] for s in range(0, 300, 37)]
    again = _mix(*two, 0.7).batches
    for s, want in reversed(list(zip(range(0, 300, 37), first, strict=True))):
        assert torch.equal(again.batch(s)[0], want)  # any order, a fresh object
    other = _mix(*two, 0.7, seed=1).batches
    assert not torch.equal(other.batch(0)[0], first[0])


def test_the_small_source_runs_out_and_starts_its_next_epoch(two):
    """b holds 800 // 8 = 100 sequences; over 200 batches it is asked for about
    480: every sequence comes back, each about equally often."""
    batches = _mix(*two, 0.3).batches
    seen: dict[tuple[int, ...], int] = {}
    for step in range(200):
        tokens, targets = batches.batch(step)
        for row, last in zip(tokens, targets[:, -1], strict=True):
            if row[0] >= 100:
                key = (*row.tolist(), int(last))
                seen[key] = seen.get(key, 0) + 1
    assert len(seen) == 100
    assert max(seen.values()) - min(seen.values()) <= 1


def test_block_shares_give_each_source_its_share_to_one_row():
    assert block_shares([0.7, 0.3]) == [717, 307]
    assert sum(block_shares([1 / 3] * 3)) == BLOCK
    assert block_shares([1 / 3] * 3) == [342, 341, 341]


class _Counting:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.calls = fail_at, []

    def batch(self, step: int) -> tuple[int, int]:
        self.calls.append(step)
        if step == self.fail_at:
            raise ValueError(f"data file shrank at step {step}")
        return step, step * step


def test_prefetched_batches_equal_the_ones_built_on_demand_and_errors_reach_their_step():
    ahead = Prefetched(_Counting(), 3, 9)
    assert [ahead.batch(s) for s in range(3, 9)] == [(s, s * s) for s in range(3, 9)]
    assert ahead.batch(1) == (1, 1)  # out of order: built on the spot
    failing = Prefetched(_Counting(fail_at=5), 3, 9)
    assert failing.batch(3) == (3, 9) and failing.batch(4) == (4, 16)
    with pytest.raises(ValueError, match="shrank at step 5"):
        failing.batch(5)
    failing.close()
