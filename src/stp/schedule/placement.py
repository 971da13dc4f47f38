"""Which decoder layers each global pipeline stage holds.

A pipeline of S global stages (p ranks times v chunks) cuts the model's
layers into S contiguous runs, stage 0 holding the first. The rule is pure so
that the model builder, the emulated stages, the cost model and the
simulator all split the same way without importing torch; which rank holds a
stage is the schedule's placement (`Schedule.stage_to_rank`), not this.

    partition_layers(10, 4)             -> (0..2, 3..5, 6..7, 8..9)  even split
    partition_layers(10, 4, (2,3,3,2))  -> (0..1, 2..4, 5..7, 8..9)  explicit
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["partition_layers", "stage_layers"]


def _check_even(num_layers: int, num_stages: int) -> None:
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"num_stages={num_stages} must be between 1 and num_layers={num_layers} "
            "(every stage needs at least one layer)"
        )


def _even_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage of the even split: the FIRST r = num_layers % num_stages
    stages get one extra layer, because the last stage already carries the
    final norm, the head matmul (h x V) and the loss and should not also get
    the longer share."""
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def _check_counts(num_layers: int, num_stages: int, counts: Sequence[int]) -> tuple[int, ...]:
    """`counts` as a tuple, or ValueError naming what is wrong with it."""
    if len(counts) != num_stages:
        raise ValueError(
            f"counts={tuple(counts)!r} has {len(counts)} entries for {num_stages} stages; "
            "give one layer count per global stage"
        )
    for s, c in enumerate(counts):
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(
                f"counts[{s}]={c!r} not accepted: a layer count is an integer >= 1 "
                "(every stage needs at least one layer)"
            )
    if sum(counts) != num_layers:
        raise ValueError(
            f"counts={tuple(counts)!r} sum to {sum(counts)}, not num_layers={num_layers}; "
            "the stages must hold every layer exactly once"
        )
    return tuple(counts)


def partition_layers(
    num_layers: int, num_stages: int, counts: Sequence[int] | None = None
) -> tuple[range, ...]:
    """The layers of each global stage, in stage order: contiguous ranges that
    cover 0..num_layers-1 exactly once.

    `counts` gives the number of layers of each stage (uneven stages, e.g. a
    lighter last stage that also runs the head and the loss); each must be
    >= 1 and they must sum to `num_layers`. Without it the split is even, the
    first `num_layers % num_stages` stages holding one extra layer. Raises
    ValueError naming the bad value.
    """
    if counts is None:
        _check_even(num_layers, num_stages)
        sizes = _even_counts(num_layers, num_stages)
    else:
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages} must be >= 1")
        sizes = _check_counts(num_layers, num_stages, counts)
    out: list[range] = []
    start = 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return tuple(out)


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """Contiguous layer split. When num_layers % num_stages = r > 0, the FIRST r stages
    get one extra layer: the last stage already carries the final norm, the head
    matmul (h x V) and the loss, so it should not also get the longer share."""
    _check_even(num_layers, num_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} must be in [0, num_stages={num_stages})")
    return partition_layers(num_layers, num_stages)[stage]
