"""Braided execution (stp.runtime.braid): order, all-reduces in flight, held tails,
and gradients equal to the unbraided run. One process, no torch.distributed:
all-reduces are fake works whose completion the test controls."""

from __future__ import annotations

from itertools import product

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from stp.models import ModelConfig, StagePlacement, build_stage
from stp.runtime.braid import UnitRunner, stream_order
from stp.schedule.ir import Block, Kind, Pass
from stp.sim.units import braid, sequential_order

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW
BLOCKS = [
    (Pass(0, F, 1), Pass(0, F, 2)), (Pass(0, F, 1), Pass(1, B, 0)),
    (Pass(0, F, 1), Pass(1, BW, 0)), (Pass(0, F, 3), Pass(0, W, 0)),
    (Pass(0, F, 3), Pass(0, W, 0), Pass(1, W, 1)),
]


# -- order ----------------------------------------------------------------------


@pytest.mark.parametrize("passes", BLOCKS, ids=lambda ps: str(Block(ps)))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_equal_unit_counts_give_the_simulators_order(passes, n):
    action = Block(passes)
    assert stream_order(action, [n] * len(passes)) == braid(action, n)
    for p in passes:
        assert stream_order(p, [n]) == braid(p, n)


def test_paper_figure_order_for_f_with_a_full_backward():
    items = stream_order(Block((Pass(0, F, 1), Pass(1, BW, 0))), [2, 2])
    # Attn(F) | MLP B | MLP W | MLP(F) | Attn B | Attn W   (STP paper arXiv 2510.27257, Fig. 3)
    assert [(i.kind, i.unit) for i in items] == [
        ("F", 0), ("B", 1), ("W", 1), ("F", 1), ("B", 0), ("W", 0)]


@settings(max_examples=80, deadline=None)
@given(hs.sampled_from(BLOCKS), hs.lists(hs.integers(1, 6), min_size=3, max_size=3))
def test_unequal_counts_keep_each_pass_in_order_and_interleave_fairly(passes, counts):
    counts = counts[: len(passes)]
    items = stream_order(Block(passes), counts)
    for c, (p, n) in enumerate(zip(passes, counts, strict=True)):
        mine = [(i.kind, i.unit) for i in items if i.chain == c]
        assert mine == [(i.kind, i.unit) for i in braid(p, n)]  # the pass alone
    # least relative progress first: after k items of the longest chain, every
    # other chain has made at least its share of progress minus one step
    pos = [0] * len(passes)
    steps = [n * (2 if p.kind is BW else 1) for p, n in zip(passes, counts, strict=True)]
    for it in items:
        pos[it.chain] += 1
        frac = [pos[c] / steps[c] for c in range(len(passes))]
        assert max(frac) - min(frac) <= max(2 / s for s in steps) + 1e-9


def test_first_and_last_stage_blocks_braid_unequal_chains():
    # stage 0 holds the embedding: 3 units against 2 units of a middle stage
    items = stream_order(Block((Pass(0, F, 1), Pass(1, B, 0))), [3, 2])
    # least relative progress: 0/3 0/2 -> F; 1/3 0/2 -> B; 1/3 1/2 -> F; 2/3 1/2 -> B
    assert [(i.chain, i.unit) for i in items] == [(0, 0), (1, 1), (0, 1), (1, 0), (0, 2)]


def test_sequential_order_runs_pass_after_pass_with_w_after_all_b():
    items = sequential_order(Block((Pass(0, F, 1), Pass(0, BW, 0))), [2, 2])
    assert [(i.chain, i.kind, i.unit) for i in items] == [
        (0, "F", 0), (0, "F", 1), (1, "B", 1), (1, "B", 0), (1, "W", 1), (1, "W", 0)]


# -- the runner on fake units -------------------------------------------------------


class FakeWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")
        self.done = True


class FakeUnit:
    def __init__(self, stage: FakeStage, u: int) -> None:
        self.stage, self.u, self.name = stage, u, f"layers.{u // 2}.x"

    def _log(self, what: str, mb: int) -> None:
        self.stage.log.append(f"{what}{self.stage.stage}.{mb}.{self.u}")

    def forward_partial(self, mb, x, targets=None):
        self._log("Fp", mb)
        return torch.tensor([float(self.u)])

    def forward_finish(self, mb, reduced):
        self._log("Ff", mb)
        return reduced

    def backward_partial(self, mb, grad):
        self._log("Bp", mb)
        return torch.tensor([1.0])

    def backward_finish(self, mb, reduced):
        self._log("Bf", mb)
        return reduced

    def weight(self, mb):
        self._log("W", mb)


class FakeStage:
    def __init__(self, stage: int, n: int, log: list[str], first=False, last=False) -> None:
        self.stage, self.is_first, self.is_last, self.log = stage, first, last, log
        self.units = tuple(FakeUnit(self, u) for u in range(n))
        self.works: list[FakeWork] = []

    def launch_allreduce(self, partial):
        w = FakeWork(self.log, f"AR{len(self.works)}@{self.stage}")
        self.works.append(w)
        self.log.append(f"launch {w.name}")
        return partial, w

    def check_input(self, x, targets):
        pass


def _runner(stages, log, braid=True):
    outs: dict = {}
    runner = UnitRunner({st.stage: st for st in stages}, braid=braid,
                        take=lambda p: torch.zeros(1),
                        give=lambda p, y: (outs.__setitem__(str(p), y), log.append(f"give {p}")),
                        targets=lambda mb: None)
    return runner, outs


def test_block_keeps_each_all_reduce_in_flight_under_the_other_pass():
    log: list[str] = []
    st = FakeStage(1, 2, log)
    runner, outs = _runner([st], log)
    runner.run(Pass(1, F, 0))  # lone: each all-reduce waited for at once
    assert log[:4] == ["Fp1.0.0", "launch AR0@1", "wait AR0@1", "Ff1.0.0"]
    log.clear()
    runner.run(Block((Pass(1, F, 1), Pass(1, BW, 0))))
    # AR of F unit 0 runs under B+W of unit 1; AR of B unit 1 under its W
    assert log[:6] == ["Fp1.1.0", "launch AR2@1", "Bp1.0.1", "launch AR3@1", "W1.0.1",
                       "wait AR2@1"]
    assert log.index("wait AR3@1") > log.index("W1.0.1")
    # the block's last all-reduces are held: outputs not given yet
    assert "give 1F1" not in log and runner.holds(("F", 1, 1))
    st.works[-1].done = st.works[-2].done = True  # they complete in the background
    runner.poll()
    assert "give 1F1" in log and "give 1B0" in log and not runner.holds(("F", 1, 1))
    assert log.index("wait AR3@1") < log.index("give 1B0")


def test_held_tails_are_released_before_blocking_and_when_needed():
    log: list[str] = []
    st = FakeStage(1, 2, log)
    runner, _ = _runner([st], log)
    runner.run(Pass(1, F, 0))
    runner.run(Block((Pass(1, F, 1), Pass(1, B, 0))))
    assert runner.holds(("F", 1, 1)) and runner.holds(("B", 1, 0))
    log.clear()
    runner.run(Pass(1, F, 2))  # its first wait (on AR6) blocks: the older held tails go first
    blocked = log.index("wait AR6@1")
    assert "give 1F1" in log[:blocked] and "give 1I0" in log[:blocked]
    runner.run(Block((Pass(1, F, 3), Pass(1, W, 0))))
    assert runner.holds(("F", 1, 3))
    # F4's second unit blocks on F4's first all-reduce: the older F3 tail goes first,
    # F4's own tail (launched after) stays held
    runner.run(Block((Pass(1, F, 4), Pass(1, W, 1))))
    assert not runner.holds(("F", 1, 3)) and runner.holds(("F", 1, 4))
    runner.release(("F", 1, 4))
    assert not runner.holds(("F", 1, 4)) and log[-1] == "give 1F4"


def test_backward_of_a_held_forward_finishes_that_forward_first():
    log: list[str] = []
    st = FakeStage(1, 2, log, last=True)
    runner, _ = _runner([st], log)
    runner.run(Pass(1, F, 0))
    runner.run(Block((Pass(1, F, 1), Pass(1, B, 0))))
    runner.run(Pass(1, B, 1))
    assert log.index("Ff1.1.1") < log.index("Bp1.1.1")


def test_unbraided_runs_waits_every_all_reduce_at_once():
    log: list[str] = []
    st = FakeStage(1, 2, log)
    runner, _ = _runner([st], log, braid=False)
    runner.run(Pass(1, F, 0))
    log.clear()
    runner.run(Block((Pass(1, F, 1), Pass(1, BW, 0))))
    launches = [i for i, e in enumerate(log) if e.startswith("launch")]
    assert all(log[i + 1].startswith("wait") for i in launches)
    assert log.index("Ff1.1.1") < log.index("Bp1.0.1")  # F fully before B
    assert not runner.holds(("F", 1, 1))
    assert runner.stats.launched == 6


# -- gradients: braided units against the stage's own pass-level methods ------------


CFG = ModelConfig(vocab_size=32, hidden=16, num_layers=4, num_heads=4, num_kv_heads=2,
                  ffn_hidden=32, max_seq_len=8, seed=5)


def _data(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(mb)
    t = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
    return t[:, :-1], t[:, 1:]


@pytest.mark.parametrize("split", ["bw", "b+w"])
def test_braided_blocks_give_the_stage_methods_gradients(split):
    """F with a full backward (early W under the all-reduce) and F with B then a
    deferred W braided with F: gradients equal a pass-at-a-time run."""
    def grads(run) -> dict[str, torch.Tensor]:
        st = build_stage(CFG, StagePlacement(0, 1, dtype=torch.float64))
        run(st)
        return {n: p.grad.clone() for n, p in st.named_parameters()}

    def by_methods(st):
        for mb in range(3):
            st.forward(mb, *_data(mb))
        for mb in range(3):
            if split == "bw":
                st.backward_full(mb, None, 1 / 3)
            else:
                st.backward_input(mb, None, 1 / 3)
                st.backward_weight(mb)

    def braided(st):
        runner = UnitRunner({0: st}, take=lambda p: _data(p.mb)[0], give=lambda p, y: None,
                            targets=lambda mb: _data(mb)[1])
        runner.scale = 1 / 3
        kind = BW if split == "bw" else B
        runner.run(Pass(0, F, 0))
        runner.run(Block((Pass(0, F, 1), Pass(0, kind, 0))))
        runner.run(Block((Pass(0, F, 2), Pass(0, kind, 1))))
        if split == "b+w":
            runner.run(Pass(0, W, 0))
        runner.run(Pass(0, kind, 2))
        for mb in (1, 2) if split == "b+w" else ():
            runner.run(Pass(0, W, mb))
        runner.release()
        assert not st.pending_backward() and not st.pending_weight()

    ref, got = grads(by_methods), grads(braided)
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=1e-12, atol=1e-14), name


def test_early_weight_is_refused_before_the_backward_started():
    st = build_stage(CFG, StagePlacement(0, 1, dtype=torch.float64))
    st.forward(0, *_data(0))
    with pytest.raises(RuntimeError, match="before its backward finished"):
        st.units[1].weight(0)


@pytest.mark.parametrize("kinds", list(product([F], [F, B, BW, W])))
def test_runner_refuses_nothing_the_ir_accepts(kinds):
    # every block kind of the STP paper (F+F, F+B, F+BW, F+W) has a stream order
    ps = tuple(Pass(0, k, mb) for mb, k in enumerate(kinds))
    assert len(stream_order(Block(ps), [3, 4])) >= 7
