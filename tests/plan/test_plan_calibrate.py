"""`stp plan --calibrate`: hardware fields fitted back from a trace of known costs."""

import json
from dataclasses import replace

import pytest

from stp.cli.main import main
from stp.costmodel.decoder.costs import decoder_layered_costs, derive_decoder, head_flops
from stp.costmodel.decoder.spec import ModelSpec, layer_flops
from stp.costmodel.hardware import HardwareSpec
from stp.plan.calibrate import calibrated, fit_traces
from stp.schedule import generate
from stp.sim.engine import simulate
from stp.sim.trace_format import trace_events

SPEC = ModelSpec(layers=4, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=512, sequence=128,
                 tp=2, flash_attention=True, dropout=False)
# Links so fast that every transfer is its latency: what a calibration run measures.
TRUE = HardwareSpec(peak_flops=1e12, efficiency=0.3, tp_bandwidth=1e18, tp_latency=2e-4,
                    pp_bandwidth=1e18, pp_latency=5e-4, host_bandwidth=1e9, memory=1e10)


def _trace(tmp_path, spec: ModelSpec = SPEC) -> str:
    sch = generate("1f1b", 2, 4)
    d = derive_decoder(spec, TRUE, 2)
    table = decoder_layered_costs(spec, TRUE, 2, d.costs, d.mem).table((2, 2))
    res = simulate(sch, stages=table)
    names = {(r, i): str(a) for r, acts in enumerate(sch.actions) for i, a in enumerate(acts)}
    doc = {"traceEvents": trace_events(res.spans, action_names=names, time_scale=1e3),
           "otherData": {"source": "stp runtime (measured)", "microbatches": 4, "pp": 2,
                         "tp": spec.tp, "partition": [2, 2]}}
    path = tmp_path / f"trace-tp{spec.tp}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_fit_recovers_latencies_and_efficiency(tmp_path):
    per_stage = 2 * sum(layer_flops(SPEC))
    fit = fit_traces([_trace(tmp_path)], [per_stage, per_stage + 3 * head_flops(SPEC)])
    got = fit.apply(replace(TRUE, efficiency=0.9, tp_latency=1.0, pp_latency=1.0))
    assert got.tp_latency == pytest.approx(TRUE.tp_latency, rel=1e-3)
    # within 5%: `stp costs` adds each rank's mean dispatch gap to its passes
    assert got.efficiency == pytest.approx(TRUE.efficiency, rel=0.05)
    assert got.name.endswith("+calibrated")


def test_send_latency_from_a_trace_without_tp(tmp_path):
    got = calibrated(replace(TRUE, pp_latency=1.0), [_trace(tmp_path, replace(SPEC, tp=1))])
    # within 10%: `stp costs` takes each rank's mean dispatch gap off the latency
    assert got.pp_latency == pytest.approx(TRUE.pp_latency, rel=0.1)


def test_calibrate_without_flops_keeps_the_efficiency(tmp_path):
    base = replace(TRUE, efficiency=0.9, tp_latency=1.0)
    got = calibrated(base, [_trace(tmp_path)])
    assert got.efficiency == 0.9 and got.tp_latency == pytest.approx(2e-4, rel=1e-3)


def test_calibrate_flag_and_bad_traces(capsys, tmp_path):
    argv = ["plan", "--model", "layers=4,hidden=256,heads=4,kv_heads=4,ffn=1024,vocab=512,"
            "sequence=128", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--seq-len", "128", "--hardware", "a100-80g", "--schedules", "1f1b", "--json"]
    assert main([*argv, "--calibrate", _trace(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["request"]["hardware"] == "a100-80g+calibrated"
    bad = tmp_path / "bad.json"
    for text in ("[]", '{"traceEvents": []}', "nope"):
        bad.write_text(text)
        assert main([*argv, "--calibrate", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("stp: error:")
