"""stp.sim: the cases tests/sim never set up.

Written to kill mutants mutmut left alive in stp/sim/ (docs/testing.md). The
reference is the timeline worked by hand from stp.sim.dp_overlap's module doc.
Each test names the bug it guards against.
"""

from __future__ import annotations

from stp.sim.dp_overlap import dp_timeline


def test_a_stage_without_a_final_pass_is_reduced_from_the_compute_end() -> None:
    """A stage with a reduction but no recorded last gradient pass is ready when the
    rank's compute ends (10): its 3 units run 10..13, all exposed; the other stage,
    final at 4, runs 4..6 first. Kills: the missing stage's start read as None
    (a TypeError) instead of the compute end."""
    line = dp_timeline({0: 4.0}, {0: 2.0, 1: 3.0}, 10.0)
    assert (line.end, line.total, line.exposed) == (13.0, 5.0, 3.0)
