"""Lowering (stp.schedule.lower): pure checks over every registered schedule."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stp.schedule import Block, Kind, Pass, Schedule, registry, validate
from stp.schedule.io import from_rows
from stp.schedule.ir import passes_of
from stp.schedule.lower import Comm, CommOp, lower, messages_in, messages_out


def _cases() -> list[tuple[str, int, int]]:
    cases = []
    for name in registry.names():
        spec = registry.get(name)
        for p in (1, 2, 3, 4):
            if p < spec.min_ranks:
                continue
            lo = 1
            for m in sorted({lo, lo + 1, 2 * lo + 3}):
                cases.append((name, p, m))
    return cases


def check_lowered(sch: Schedule, lookahead: int) -> None:
    """Every invariant the executor relies on; raises AssertionError."""
    low = lower(sch, lookahead=lookahead)
    S, owner = sch.num_stages, sch.stage_to_rank
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for r, prog in enumerate(low.actions):
        # 1. The compute order is the schedule's, untouched.
        assert low.compute(r) == list(sch.actions[r])
        compute_idx = -1
        posted: dict[tuple, int] = {}
        last_compute = None
        for a in prog:
            if isinstance(a, Comm):
                assert owner[a.stage] == r and owner[a.peer_stage] == a.peer != r
                if a.op.is_send:
                    # 2. A send follows the action that produced it, in that action's slot.
                    assert last_compute is not None
                    produced = [m for p in passes_of(last_compute) for m in messages_out(p, S)]
                    assert a.message in produced, (r, str(a), str(last_compute))
                    sent[(r, a.peer)].append(a.message)
                else:
                    posted[a.message] = compute_idx + 1
                    received[(a.peer, r)].append(a.message)
                continue
            compute_idx += 1
            last_compute = a
            for p in passes_of(a):
                for msg in messages_in(p, S):
                    if owner[msg[1]] == r:
                        assert msg not in posted  # 3. local hand-off: no receive
                    else:
                        # 4. Received before it is needed, early by the lookahead
                        # unless the channel order moved it even earlier.
                        assert msg in posted, (r, str(p), msg)
                        assert posted[msg] <= max(0, compute_idx - lookahead)
    # 5. Every cross-rank message: one send, one receive, same order per channel.
    assert dict(sent) == dict(received)
    for msgs in sent.values():
        assert len(set(msgs)) == len(msgs)


@pytest.mark.parametrize("name,p,m", _cases())
def test_lowering_invariants_for_every_schedule(name: str, p: int, m: int) -> None:
    sch = registry.generate(name, p, m)
    validate(sch)
    for lookahead in (0, 1, 3):
        check_lowered(sch, lookahead)


@given(
    name=st.sampled_from(registry.names()),
    p=st.integers(1, 6),
    extra=st.integers(0, 9),
    lookahead=st.integers(0, 4),
)
@settings(max_examples=60, deadline=None)
def test_lowering_invariants_property(name: str, p: int, extra: int, lookahead: int) -> None:
    spec = registry.get(name)
    if p < spec.min_ranks:
        return
    sch = registry.generate(name, p, 1 + extra)
    check_lowered(sch, lookahead)


def test_one_f_one_b_golden_two_ranks() -> None:
    sch = from_rows([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    assert lower(sch, lookahead=0).rows() == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
    # One action ahead: the receive for 0B0 is posted before 0F1 runs.
    assert lower(sch).rows()[0] == [
        "0F0", "0SEND_F0", "0RECV_B0", "0F1", "0SEND_F1", "0RECV_B1", "0B0", "0B1",
    ]


def test_v_tip_is_local() -> None:
    p = 3
    sch = registry.generate("zb-v", p, 2 * p)
    low = lower(sch)
    tip = [str(a) for a in low.actions[p - 1] if isinstance(a, Comm)]
    assert not any(s.startswith(f"{p - 1}SEND_F") for s in tip)
    assert not any(s.startswith(f"{p}RECV_F") for s in tip)
    assert not any(s.startswith(f"{p}SEND_B") for s in tip)
    assert not any(s.startswith(f"{p - 1}RECV_B") for s in tip)
    # ...while the other hand-offs of that rank do communicate.
    assert any(s.startswith(f"{p - 1}RECV_F") for s in tip)
    # One pipeline rank: nothing to send at all.
    assert all(not isinstance(a, Comm) for a in lower(registry.generate("stp", 1, 2)).actions[0])


def test_channel_order_moves_receives_earlier() -> None:
    # Rank 0 sends F0 of mb 1 before mb 0; rank 1 consumes mb 0 first. In the
    # sender's order, the receive of mb 1 must be posted before that of mb 0.
    sch = Schedule(
        "swap", 2, 2, (0, 1),
        (
            (Pass(0, Kind.F, 1), Pass(0, Kind.F, 0), Pass(0, Kind.BW, 0), Pass(0, Kind.BW, 1)),
            (Pass(1, Kind.F, 0), Pass(1, Kind.BW, 0), Pass(1, Kind.F, 1), Pass(1, Kind.BW, 1)),
        ),
    )
    validate(sch)
    rows = lower(sch, lookahead=0).rows()
    assert rows[1][:3] == ["1RECV_F1", "1RECV_F0", "1F0"]
    check_lowered(sch, 0)


def test_block_sends_follow_the_block() -> None:
    sch = registry.generate("stp", 2, 5)
    low = lower(sch)
    blocks = 0
    for prog in low.actions:
        for i, a in enumerate(prog):
            if isinstance(a, Block):
                blocks += 1
                outs = {m for p in a.passes for m in messages_out(p, sch.num_stages)}
                j = i + 1
                while j < len(prog) and isinstance(prog[j], Comm):
                    if prog[j].op.is_send:
                        assert prog[j].message in outs
                    j += 1
    assert blocks > 0


def test_comm_text_and_errors() -> None:
    c = Comm(1, CommOp.SEND_F, 3, peer=2)
    assert str(c) == "1SEND_F3" and c.peer_stage == 2 and c.message == ("F", 1, 3)
    r = Comm(2, CommOp.RECV_F, 3, peer=1)
    assert r.message == c.message
    assert Comm(2, CommOp.SEND_B, 3, 1).message == Comm(1, CommOp.RECV_B, 3, 2).message
    sch = registry.generate("1f1b", 2, 2)
    with pytest.raises(ValueError, match="lookahead"):
        lower(sch, lookahead=-1)
    # A schedule where rank 0 runs no forward of mb 1 cannot be lowered.
    broken = from_rows([["0F0", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    with pytest.raises(ValueError, match="never sends"):
        lower(broken)
