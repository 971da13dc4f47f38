"""Tests of the layer placement rule (stp.schedule.placement)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stp.schedule import partition_layers, stage_layers


def _covers_in_order(parts: tuple[range, ...], num_layers: int) -> bool:
    return [i for r in parts for i in r] == list(range(num_layers))


def test_even_split_gives_the_extra_layers_to_the_first_stages() -> None:
    assert partition_layers(10, 4) == (range(0, 3), range(3, 6), range(6, 8), range(8, 10))
    assert partition_layers(8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert partition_layers(3, 1) == (range(0, 3),)


@settings(deadline=None)  # no wall-time bound: a loaded machine is slow
@given(num_layers=st.integers(1, 64), data=st.data())
def test_even_split_is_contiguous_balanced_and_front_heavy(num_layers: int, data) -> None:
    num_stages = data.draw(st.integers(1, num_layers))
    parts = partition_layers(num_layers, num_stages)
    assert len(parts) == num_stages
    assert _covers_in_order(parts, num_layers)
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the last stage never holds more
    assert all(stage_layers(num_layers, s, num_stages) == parts[s] for s in range(num_stages))


def test_explicit_counts_give_each_stage_its_share() -> None:
    assert partition_layers(10, 4, (2, 3, 3, 2)) == (
        range(0, 2), range(2, 5), range(5, 8), range(8, 10)
    )
    assert partition_layers(5, 2, [4, 1]) == (range(0, 4), range(4, 5))


@settings(deadline=None)  # no wall-time bound: a loaded machine is slow
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=12))
def test_explicit_counts_cover_every_layer_once(counts: list[int]) -> None:
    parts = partition_layers(sum(counts), len(counts), counts)
    assert [len(r) for r in parts] == counts
    assert _covers_in_order(parts, sum(counts))


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "counts", "match"),
    [
        (8, 4, (2, 2, 4), r"counts=\(2, 2, 4\) has 3 entries for 4 stages"),
        (8, 4, (2, 2, 2, 2, 0), r"has 5 entries for 4 stages"),
        (8, 4, (3, 3, 2, 0), r"counts\[3\]=0 not accepted"),
        (8, 4, (3, 3, 3, -1), r"counts\[3\]=-1 not accepted"),
        (8, 2, (4.0, 4), r"counts\[0\]=4.0 not accepted"),
        (8, 2, (True, 7), r"counts\[0\]=True not accepted"),
        (8, 4, (2, 2, 2, 3), r"sum to 9, not num_layers=8"),
        (8, 0, (), r"num_stages=0 must be >= 1"),
    ],
)
def test_bad_counts_are_refused_naming_the_value(num_layers, num_stages, counts, match) -> None:
    with pytest.raises(ValueError, match=match):
        partition_layers(num_layers, num_stages, counts)


@pytest.mark.parametrize(("num_layers", "num_stages"), [(3, 4), (3, 0), (0, 1)])
def test_even_split_needs_a_layer_per_stage(num_layers: int, num_stages: int) -> None:
    with pytest.raises(ValueError, match=f"num_stages={num_stages} must be between 1"):
        partition_layers(num_layers, num_stages)
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        stage_layers(num_layers, 0, num_stages)


@pytest.mark.parametrize("stage", [-1, 4])
def test_stage_layers_refuses_a_stage_outside_the_pipeline(stage: int) -> None:
    with pytest.raises(ValueError, match=rf"stage={stage} must be in \[0, num_stages=4\)"):
        stage_layers(8, stage, 4)
