"""In-layer TP overlap's chunk maths in one process (stp.models.tp.overlap): the chunk
layout, the chunked all-gather and reduce-scatter, and W's chunked regather, each
against the unchunked collective or the sum written out by hand. The TP ranks are
simulated by a fake process group that completes its i-th collective once every
rank has made its i-th call (all launches come before any wait here, as in the
units). Each test names the bug it guards against."""

from __future__ import annotations

import pytest
import torch

from stp.models.tp.overlap import (
    ChunkedGather,
    ChunkedRegather,
    ChunkedScatter,
    check_chunks,
    to_chunks,
    to_sequence,
)
from stp.models.tp.sequence import SequenceParallel, _RegatheredLinearFn
from stp.models.tp.wgrad import LinearGrad

D = torch.float64


class _Work:
    def __init__(self, call: list) -> None:
        self.call = call

    def wait(self) -> None:
        assert self.call[0] == 0, "waited for before every rank launched it"

    def is_completed(self) -> bool:
        return self.call[0] == 0


class _Group:
    """One simulated rank's handle on a shared fake process group."""

    def __init__(self, shared: dict, size: int, rank: int) -> None:
        self.shared, self.size, self.rank, self.calls = shared, size, rank, 0

    def _call(self, out: torch.Tensor, inp: torch.Tensor, finish) -> _Work:  # noqa: ANN001
        slot = self.shared.setdefault(self.calls, [self.size, {}])
        self.calls += 1
        slot[0] -= 1
        slot[1][self.rank] = (out, inp.clone())
        if slot[0] == 0:
            finish([slot[1][r] for r in range(self.size)])
        return _Work(slot)

    def _reduce_scatter_base(self, out, blocks, opts):  # noqa: ANN001
        def finish(calls):  # noqa: ANN001
            total = sum(b for _, b in calls)
            for r, (o, _) in enumerate(calls):
                o.copy_(total.chunk(self.size)[r])
        return self._call(out, blocks, finish)

    def _allgather_base(self, blocks, local, opts):  # noqa: ANN001
        def finish(calls):  # noqa: ANN001
            gathered = torch.cat([loc for _, loc in calls])
            for b, _ in calls:
                b.copy_(gathered)
        return self._call(blocks, local, finish)


def _ranks(size: int) -> list[SequenceParallel]:
    shared: dict = {}
    return [SequenceParallel(_Group(shared, size, r), size, r)  # type: ignore[arg-type]
            for r in range(size)]


def _positions(b: int, s: int, h: int = 1) -> torch.Tensor:
    """[b, s, h] whose every entry names its row: 1000 * batch + position."""
    pos = torch.arange(s, dtype=D).view(1, s, 1) + 1000 * torch.arange(b, dtype=D).view(b, 1, 1)
    return pos.expand(b, s, h).clone()


def test_chunk_k_holds_piece_k_of_every_ranks_rows_and_to_sequence_inverts_it() -> None:
    """Kills: chunks cut from the whole sequence instead of each rank's rows (the
    gather of piece k would not match), pieces taken batch-major, `to_sequence` not
    putting each row back at its position (RoPE and the causal mask would see wrong
    positions)."""
    t, k, p, b = 2, 3, 2, 2
    s = t * k * p
    full = _positions(b, s, 4)
    chunks = to_chunks(full, t, k)
    for i, c in enumerate(chunks):
        want = [r * (s // t) + i * p + j for r in range(t) for j in range(p)]
        assert c.shape == (b, t * p, 4)
        assert c[0, :, 0].tolist() == want and c[1, :, 0].tolist() == [1000 + w for w in want]
    assert torch.equal(to_sequence(chunks, t), full)


def test_chunked_gather_gives_what_the_chunk_layout_says() -> None:
    """Kills: a rank's pieces launched out of order, a piece of the wrong rows, a chunk
    waited for twice. Reference: to_chunks of the whole gathered sequence."""
    t, k, b, s = 2, 2, 3, 8
    full = _positions(b, s, 3)
    seqs = _ranks(t)
    gathers = [ChunkedGather(seq, seq.rows(full), k) for seq in seqs]
    want = to_chunks(full, t, k)
    for g in gathers:
        for i in range(k):
            assert torch.equal(g.wait(i), want[i])
        with pytest.raises(AssertionError, match="twice"):
            g.wait(0)


def test_chunked_scatter_lays_every_chunk_into_this_ranks_rows() -> None:
    """Kills: the pieces laid at the wrong offsets or in the wrong order, the earlier
    chunks' works not waited for (or not completed before the rows are read), the
    last chunk dropped. Reference: the unchunked reduce-scatter of the summed partials."""
    t, k, b, s, h = 2, 4, 2, 16, 3
    gen = torch.Generator().manual_seed(4)
    partials = [torch.randn(b, s, h, dtype=D, generator=gen) for _ in range(t)]
    seqs = _ranks(t)
    launched = []
    for seq, partial in zip(seqs, partials, strict=True):
        chunks = to_chunks(partial, t, k)
        flying = [seq.launch_scatter(c) for c in chunks[:-1]]
        launched.append(ChunkedScatter(chunks[-1], flying).launch(seq))
    total = sum(partials)
    for r, (out, work) in enumerate(launched):
        assert work.is_completed() and work.wait()
        assert torch.equal(out, seqs[r].rows(total)), r


class _Late:
    """An earlier chunk's reduce-scatter still in flight."""

    done = False

    def is_completed(self) -> bool:
        return self.done


def test_chunked_scatter_is_not_complete_until_its_earlier_chunks_are() -> None:
    """Kills: completion read from the last chunk's work alone (the runner would read
    rows whose first pieces have not arrived)."""
    seqs = _ranks(2)
    chunks = to_chunks(torch.ones(1, 4, 1, dtype=D), 2, 2)
    late = _Late()
    out, work = ChunkedScatter(chunks[1], [(torch.zeros(1, 1, 1, dtype=D), late)]).launch(
        seqs[0])
    seqs[1].launch_scatter(chunks[1])  # the last chunk's reduce-scatter completes
    assert not work.is_completed()
    late.done = True
    assert work.is_completed() and out[0, 1, 0] == 2.0


def test_w_regathers_chunk_by_chunk_and_sums_dw_over_the_chunks() -> None:
    """Kills: W reading another chunk's rows, a piece of the kept rows other than
    chunk k's, the chunks' gathers launched in another order on one rank. Reference:
    dW = dy^T x on the whole gathered input (LinearGrad)."""
    t, k, b, s, n_in, n_out = 2, 2, 2, 8, 3, 5
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(b, s, n_in, dtype=D, generator=gen)
    weight = torch.randn(n_out, n_in, dtype=D, generator=gen)
    dy = torch.randn(b, s, n_out, dtype=D, generator=gen)
    seqs = _ranks(t)
    sinks: list[list] = [[] for _ in range(t)]
    for seq, sink in zip(seqs, sinks, strict=True):
        source = ChunkedRegather(seq, seq.rows(full), k, sink)
        for i, (x_i, dy_i) in enumerate(zip(to_chunks(full, t, k), to_chunks(dy, t, k),
                                            strict=True)):
            leaf = source.take(i, x_i.clone())
            y = _RegatheredLinearFn.apply(leaf, weight, source._inputs[id(leaf)], None)
            y.backward(dy_i)
            p = s // t // k
            assert torch.equal(sink[-1].x, seq.rows(full).narrow(1, i * p, p))
    owner = sinks[0][0].source.owner  # rank 0's regathers launched before rank 1's W
    owner._again_chunks = ChunkedGather(owner.seq, owner.rows, k)
    grads = []
    for sink in reversed(sinks):
        weight.grad = None
        for entry in sink:
            entry.accumulate()
        grads.append(weight.grad.clone())
    ref = weight.detach().clone()
    LinearGrad(ref, full, dy).accumulate()
    for g in grads:
        torch.testing.assert_close(g, ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq_len, tp, chunks, ok", [
    (16, 2, 4, True), (16, 2, 8, True), (16, 2, 3, False), (12, 4, 2, False), (12, 1, 5, True),
])
def test_chunks_must_divide_each_ranks_rows(seq_len: int, tp: int, chunks: int, ok: bool) -> None:
    """Kills: the check made on the whole sequence (16 / 3 fails either way, but 12 rows
    over tp 4 are 3 a rank: 2 chunks divide 12, not 3), or made at tp 1 (no effect)."""
    if ok:
        check_chunks(seq_len, tp, chunks)
        return
    with pytest.raises(ValueError, match=f"--tp-overlap-chunks {chunks}:") as e:
        check_chunks(seq_len, tp, chunks)
    assert "\n" not in str(e.value) and f"--seq-len {seq_len}" in str(e.value)


def _mlp_ranks(chunks: int, t: int = 2, h: int = 4, ffn: int = 8):
    """t simulated TP ranks of one MLP unit (same seeded weights, split as TP splits them)."""
    from stp.models.decoder.units import MLPUnit

    gen = torch.Generator().manual_seed(11)
    norm = torch.rand(h, dtype=D, generator=gen) + 0.5
    w1, w3 = (torch.randn(ffn, h, dtype=D, generator=gen) for _ in range(2))
    w2 = torch.randn(h, ffn, dtype=D, generator=gen)
    units = []
    for r, seq in enumerate(_ranks(t)):
        cut = slice(r * ffn // t, (r + 1) * ffn // t)
        unit = MLPUnit(0, norm, w1[cut], w3[cut], w2[:, cut], eps=1e-6)
        unit.seq, unit.overlap = seq, chunks
        units.append(unit)
    return units


def _mlp_step(units, x: torch.Tensor, g: torch.Tensor):  # noqa: ANN001
    """Every rank's forward output and input gradient (this rank's rows), the ranks
    interleaved as real ones would be: each collective launched by all before a wait."""
    def reduced(parts):  # noqa: ANN001
        launched = [p.launch(u.seq) for p, u in zip(parts, units, strict=True)]
        for _, work in launched:
            work.wait()
        return [out for out, _ in launched]

    for u in units:
        u.prepare_forward(0, u.seq.rows(x))
    ys = [u.forward_finish(0, r) for u, r in zip(units, reduced(
        [u.forward_partial(0, u.seq.rows(x)) for u in units]), strict=True)]
    for u in units:
        u.prepare_backward(0, u.seq.rows(g))
    dxs = [u.backward_finish(0, r) for u, r in zip(units, reduced(
        [u.backward_partial(0, u.seq.rows(g)) for u in units]), strict=True)]
    return ys, dxs


@pytest.mark.parametrize("chunks", [2, 4])
def test_a_chunked_mlp_unit_equals_the_unchunked_one(chunks: int) -> None:
    """Kills: a chunk's partial sum scattered into another chunk's rows, the last chunk
    not handed to the runner, B's chunks walked against the wrong output gradient.
    Reference: the same unit with sequence parallelism and no chunks."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 4, dtype=D, generator=gen)
    g = torch.randn(2, 8, 4, dtype=D, generator=gen)
    want_y, want_dx = _mlp_step(_mlp_ranks(0), x, g)
    got_y, got_dx = _mlp_step(_mlp_ranks(chunks), x, g)
    for a, b in zip([*got_y, *got_dx], [*want_y, *want_dx], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_set_overlap_reaches_the_sequence_parallel_units_and_refuses_full_recompute() -> None:
    """Kills: the chunks given to units without sequence parallelism (one TP rank: no
    collective to cut), full recomputation let through (its rebuild is unchunked)."""
    from stp.models.decoder.stage_setup import set_overlap

    units = _mlp_ranks(0)
    lone = _mlp_ranks(0)[0]
    lone.seq = None
    assert set_overlap([*units, lone], 4, "selective") == 4
    assert [u.overlap for u in units] == [4, 4] and lone.overlap == 0
    with pytest.raises(ValueError, match="--recompute full"):
        set_overlap(units, 2, "full")
    with pytest.raises(ValueError, match="tp_overlap_chunks"):
        set_overlap(units, -1, "none")
