"""The executor's `params_needed(stage)` hook (stp.runtime.executor), the mirror image of
`grads_final`: where the trainer waits for a stage's parameters gathered since
the last optimizer step (stp.train.step.param_gather).

In one process, every schedule on one pipeline rank (two stages on it for the
V and interleaved ones; braided blocks for STP and DualPipeV), the executor
only, on the toy stages of test_executor_toy: over two runs the hook is
called once per stage per run, before the stage's first forward with no
forward between the two, and a stage used late (ZB-V's stage 1 on one rank)
is asked for after stage 0's forward ran.
"""

from __future__ import annotations

import pytest
import torch
from test_executor_toy import HIDDEN, MBS, SEQ, ToyStage, _batch

from stp.runtime.executor import Executor, first_forward_actions
from stp.schedule import registry
from stp.schedule.ir import Kind, passes_of
from stp.schedule.lower import Comm, lower


class _Logged(ToyStage):
    """A toy stage that logs its forwards in `log`."""

    def __init__(self, log: list, *args) -> None:
        super().__init__(*args)
        self.log = log

    def forward(self, mb, x, targets=None):
        self.log.append(("F", self.stage))
        return super().forward(mb, x, targets)


def _events(name: str) -> tuple[list[tuple[str, int]], int]:
    """(what one rank logged over two runs, its number of stages)."""
    sch = registry.make(name, 1)
    m, layers, log = sch.num_microbatches, 2 * sch.num_stages, []
    stages = {s: _Logged(log, s, sch.num_stages, layers) for s in sch.stages_of(0)}
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, HIDDEN),
                  dtype=torch.float64, params_needed=lambda s: log.append(("needed", s)))
    for run in range(2):
        tokens, targets = _batch(m, seed=run)
        log.append(("run", run))
        ex.run(list(tokens.chunk(m)), list(targets.chunk(m)))
    return log, sch.num_stages


@pytest.mark.parametrize("name", registry.names())
def test_each_stage_is_asked_for_once_per_run_right_before_its_first_forward(
        name: str) -> None:
    log, num_stages = _events(name)
    runs = [i for i, e in enumerate(log) if e[0] == "run"] + [len(log)]
    for start, stop in zip(runs, runs[1:], strict=False):
        events = log[start + 1 : stop]
        asked = [s for kind, s in events if kind == "needed"]
        assert sorted(asked) == list(range(num_stages)), (name, events)
        for stage in range(num_stages):
            first = events.index(("F", stage))
            needed = events.index(("needed", stage))
            assert needed < first, (name, stage, events)
            # just before: no forward runs between the two
            assert all(e[0] != "F" for e in events[needed + 1 : first]), (name, stage, events)


def test_a_stage_first_used_late_is_asked_for_late() -> None:
    log, _ = _events("zb-v")  # one rank: 0F0 1F0 1I0 1W0 ..: stage 1 after stage 0's F
    events = log[1 : log.index(("run", 1))]
    assert events.index(("needed", 1)) > events.index(("F", 0)), events


def test_first_forward_actions_counts_compute_actions_only() -> None:
    sch = registry.make("zb-v", 2, 4)
    for rank in range(2):
        program = lower(sch).actions[rank]
        first = first_forward_actions(program)
        compute = [a for a in program if not isinstance(a, Comm)]
        for stage, index in first.items():
            kinds = [(p.stage, p.kind) for p in passes_of(compute[index])]
            assert (stage, Kind.F) in kinds
            earlier = [(p.stage, p.kind) for a in compute[:index] for p in passes_of(a)]
            assert (stage, Kind.F) not in earlier
