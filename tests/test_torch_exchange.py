"""Exchange with torch.distributed.pipelining: our CSV through PyTorch's own
checks, and PyTorch's own schedules through our simulator.

The only test of stp.viz/io's side that imports torch. PyTorch's schedule
classes build their `pipeline_order` for every rank in the constructor and
need no process group, only stage objects with a handful of attributes, so
light fakes stand in for `PipelineStage`.
"""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace

import pytest

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import schedules as ts  # noqa: E402

from stp.schedule import Schedule, generate, io  # noqa: E402
from stp.schedule.registry import SCHEDULES  # noqa: E402
from stp.sim import Costs, simulate  # noqa: E402


def fake_stages(num_ranks: int, chunks: int) -> list[SimpleNamespace]:
    """What PyTorch's schedule constructors read from their stages."""
    return [
        SimpleNamespace(
            num_stages=num_ranks * chunks, group_size=num_ranks, group_rank=0,
            submod=None, stage_index=c * num_ranks,
        )
        for c in range(chunks)
    ]


def torch_compute_order(csv_text: str) -> dict[int, list]:
    """Parse our CSV with PyTorch's own action parser, cell by cell."""
    rows = [line.split(",") for line in csv_text.splitlines()]
    return {r: [ts._Action.from_str(c) for c in row if c] for r, row in enumerate(rows)}


def expand_overlap(order: dict[int, list]) -> dict[int, list]:
    """OVERLAP_F_B -> its sub-actions in order: what PyTorch's runtime runs
    when no custom function is registered, and what its dry run understands."""
    out = {}
    for r, acts in order.items():
        flat = []
        for a in acts:
            if a.computation_type == ts.OVERLAP_F_B:
                flat.extend(a.sub_actions)
            else:
                flat.append(a)
        out[r] = flat
    return out


def _cases() -> list[tuple[str, int, int]]:
    cases = []
    for name, spec in SCHEDULES.items():
        for p in (2, 3, 4):
            if p < spec.min_ranks:
                continue
            m0 = 1
            for m in sorted({m0, max(m0, 3 * p + 1)}):
                cases.append((name, p, m))
    return cases


def _generate(name: str, p: int, m: int) -> Schedule:
    try:
        import_module(SCHEDULES[name].module)
    except ModuleNotFoundError as e:
        if e.name == SCHEDULES[name].module:
            pytest.skip(f"generator module {e.name} not built yet")
        raise
    return generate(name, p, m)


@pytest.mark.parametrize(("name", "p", "m"), _cases())
def test_export_passes_torch_validation_lowering_and_dry_run(name, p, m, tmp_path):
    sch = _generate(name, p, m)
    text = io.dump_csv(sch)
    order = torch_compute_order(text)
    # PyTorch prints every parsed action back exactly as we wrote it
    assert [[str(a) for a in order[r]] for r in range(p)] == sch.rows()

    # _validate_schedule: counts per stage, F before I/B before W, one rank per stage
    mapping = ts._validate_schedule(order, p, sch.num_stages, m)
    assert [mapping[s] for s in range(sch.num_stages)] == list(sch.stage_to_rank)

    # the full lowering PyTorch's runtime runs on a compute-only CSV file
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    runtime = ts._PipelineScheduleRuntime(fake_stages(p, sch.chunks), m)
    runtime._load_csv(str(path))
    lowered = runtime.pipeline_order_with_comms
    sends = sum(
        a.computation_type in (ts.SEND_F, ts.SEND_B) for acts in lowered.values() for a in acts
    )
    # one send per F and per backward that crosses ranks
    crossing = sum(
        1 for s in range(sch.num_stages - 1) if sch.stage_to_rank[s] != sch.stage_to_rank[s + 1]
    )
    assert sends == 2 * m * crossing

    # dry run (no time, no overlap) of the send/receive lowering: must not hang
    with_comms = ts._add_send_recv(
        torch_compute_order(text), lambda s: mapping[s], sch.num_stages
    )
    timeline = ts._simulate_comms_compute(
        expand_overlap(with_comms), lambda s: mapping[s], sch.num_stages
    )
    ran = {str(a) for acts in timeline.values() for a in acts if a is not None}
    want = {str(q) for r in range(p) for q in sch.passes(r)}
    assert want <= ran


def _torch_csv(sched) -> str:
    """PyTorch's compute-only order as its `_dump_csv` writes it (None -> empty cell)."""
    rows = sched.pipeline_order
    return "\n".join(",".join("" if a is None else str(a) for a in rows[r]) for r in sorted(rows))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 9)])
def test_torch_zbv_imported_gives_its_bubble(p, m):
    sch = io.load_csv(_torch_csv(ts.ScheduleZBVZeroBubble(fake_stages(p, 2), m)), name="zbv")
    assert sch.stage_to_rank == tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    # zero bubble when F = B = W (Zero Bubble paper, section 6); peak p M_B
    res = simulate(sch, Costs(f=1, b=1, w=1))
    assert res.pp_bubble == pytest.approx(0, abs=1e-9)
    assert max(res.peak_activation) == pytest.approx(p)
    # STP table, per-chunk times (v = 2): PP (p-1)(T_F + 2T_AR + T_B - 2T_W), TP 4m T_AR
    c = Costs(f=2, b=2, w=1, ar=0.4)
    tf, tb, tw, tar = c.f / 2, c.b / 2, c.w / 2, c.ar / 2
    res = simulate(sch, c)
    assert res.pp_bubble == pytest.approx((p - 1) * (tf + 2 * tar + tb - 2 * tw))
    assert res.tp_bubble == pytest.approx(4 * m * tar)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 9)])
def test_torch_interleaved_1f1b_imported_gives_its_bubble(p, m):
    sch = io.load_csv(_torch_csv(ts.ScheduleInterleaved1F1B(fake_stages(p, 2), m)))
    assert sch.stage_to_rank == tuple(s % p for s in range(2 * p))
    for c in (Costs(f=1, b=1, w=1), Costs(f=1, b=2, w=1)):
        # Megatron: (p-1)(T_F+T_B+T_W)/v in whole-rank times
        assert simulate(sch, c).pp_bubble == pytest.approx((p - 1) * (c.f + c.b + c.w) / 2)
    # STP table, per-chunk times: PP (p-1)(T_F+T_AR+T_B+T_W), TP 2m T_AR
    c = Costs(f=2, b=2, w=1, ar=0.4)
    res = simulate(sch, c)
    assert res.pp_bubble == pytest.approx((p - 1) * (c.f + c.ar + c.b + c.w) / 2)
    assert res.tp_bubble == pytest.approx(2 * m * c.ar / 2)


def test_torch_refuses_what_we_refuse():
    """A backward before its forward: PyTorch's validator and ours both refuse it."""
    text = "0F0,0B1,0F1,0B0\n"
    with pytest.raises(AssertionError, match="without first running Forward"):
        ts._validate_schedule(torch_compute_order(text), 1, 1, 2)
    with pytest.raises(ValueError, match=r"row 0 \(rank 0\), cell 1: .*0B1 comes before"):
        io.load_csv(text)
