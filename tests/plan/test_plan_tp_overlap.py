"""`stp plan` chooses among none / braided / in-layer / both, and K; the GEMM fit."""

from dataclasses import replace

import pytest

from stp.costmodel import HARDWARE
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.memory import Features
from stp.plan import PlanRequest, plan
from stp.plan.calibrate import GEMM_PROBE_ROWS, gemm_rows_fit
from stp.plan.overlap import overlap_trials
from stp.plan.report import job_fields, train_flags

SMALL = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000,
                  sequence=2048, gated_mlp=True, flash_attention=True, name="small")


def _request(**kw):
    base = dict(model=SMALL, hardware=HARDWARE["h100-80g"], gpus=8, global_batch=8,
                seq_len=2048, gpus_per_node=8, schedules=("zb-v", "stp"), partition="even",
                top=2)
    base.update(kw)
    return PlanRequest(**base)


def test_trials_cover_the_modes_that_change_something():
    req = _request()
    plain = Features()
    stp = overlap_trials(req, plain, "stp", 8)
    # braiding off; then K = 2, 4, 8 with braiding on (both) and off (in-layer)
    assert [(f.braid, f.tp_overlap_chunks) for f in stp] == [
        (False, 0), (True, 2), (False, 2), (True, 4), (False, 4), (True, 8), (False, 8)]
    assert all(f.sequence_parallel for f in stp[1:])  # chunks need sequence parallelism
    zbv = overlap_trials(req, plain, "zb-v", 8)  # no braided block: braiding changes nothing
    assert [(f.braid, f.tp_overlap_chunks) for f in zbv] == [(True, 2), (True, 4), (True, 8)]
    assert overlap_trials(req, plain, "stp", 1) == []  # tp 1: nothing to overlap
    no_sp = overlap_trials(replace(req, allow_sequence_parallel=False), plain, "stp", 8)
    assert [(f.braid, f.tp_overlap_chunks) for f in no_sp] == [(False, 0)]


def test_plan_takes_the_faster_mode_and_emits_its_keys():
    """On TP-heavy meshes the chosen mode is at least as fast as the plan without
    the overlap step, and a row that chunks says so in its `stp train` job."""
    without = plan(_request(tp_overlap=False))
    chosen = plan(_request())
    assert chosen.plans[0].step_s <= without.plans[0].step_s * (1 + 1e-12)
    modes = {p.result.mode for p in chosen.plans}
    assert modes & {"both", "in-layer", "none"}, modes  # the step changed something
    for p in chosen.plans:
        job = job_fields(p, 2048)
        k = p.config.features.tp_overlap_chunks
        assert job.get("tp_overlap") is (True if k else None)
        assert job.get("tp_overlap_chunks") == (k or None)
        if k:
            assert job["sequence_parallel"] is True
            assert p.result.in_layer is not None and p.result.in_layer.chunks == k


def test_braiding_off_is_a_train_flag():
    job = {"schedule": "stp", "braid": False, "tp_overlap": True, "tp_overlap_chunks": 4}
    assert train_flags(job) == ["--schedule", "stp", "--braid", "off", "--tp-overlap",
                                "--tp-overlap-chunks", "4"]


def test_gemm_rows_fit_is_relative_throughput():
    # 256 rows at 60% of the best rate per row, 2048 the best
    secs = {256: 256 / 0.6, 512: 512 / 0.8, 1024: 1024 / 0.95, 2048: 2048.0}
    assert tuple(GEMM_PROBE_ROWS) == (256, 512, 1024, 2048)
    got = gemm_rows_fit(secs)
    assert [r for r, _ in got] == [256.0, 512.0, 1024.0, 2048.0]
    assert [e for _, e in got] == pytest.approx([0.6, 0.8, 0.95, 1.0])
    with pytest.raises(ValueError, match="not a positive time"):
        gemm_rows_fit({256: 0.0})


def test_calibrate_records_this_machines_matmul_curve(capsys, tmp_path, monkeypatch):
    """`stp plan --calibrate` times this machine's matmuls at s/K rows and the plan
    records the curve it priced in-layer overlap with (timings fixed here: a test
    must not depend on the machine's speed)."""
    import json

    import stp.cli.plan as cli_plan
    from stp.cli.main import main
    from stp.schedule import generate
    from stp.sim import Costs
    from stp.sim.engine import simulate
    from stp.sim.trace_format import trace_events

    sch = generate("1f1b", 2, 4)
    res = simulate(sch, Costs(ar=0.5, comm=0.2))
    names = {(r, i): str(a) for r, acts in enumerate(sch.actions) for i, a in enumerate(acts)}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({
        "traceEvents": trace_events(res.spans, action_names=names, time_scale=1e3),
        "otherData": {"source": "stp runtime (measured)", "microbatches": 4, "pp": 2, "tp": 2,
                      "partition": [2, 2]}}))
    monkeypatch.setattr(cli_plan, "gemm_seconds",
                        lambda: {256: 256 / 0.5, 512: 512 / 0.7, 1024: 1024.0, 2048: 2048.0})
    argv = ["plan", "--model", "layers=4,hidden=256,heads=4,kv_heads=4,ffn=1024,vocab=512,"
            "sequence=128", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--seq-len", "128", "--hardware", "a100-80g", "--schedules", "1f1b", "--json"]
    assert main([*argv, "--calibrate", str(trace)]) == 0
    got = json.loads(capsys.readouterr().out)["request"]["gemm_rows"]
    assert got == [[256.0, 0.5], [512.0, pytest.approx(0.7)], [1024.0, 1.0], [2048.0, 1.0]]
    assert main(argv) == 0  # no calibration: the preset's assumed curve
    assert json.loads(capsys.readouterr().out)["request"]["gemm_rows"][0] == [128.0, 0.6]
