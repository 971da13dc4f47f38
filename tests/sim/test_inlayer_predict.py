"""`predict_emulated`: the in-layer overlap prediction of a pp2 x tp2 emulated run."""

import pytest

from stp.schedule.registry import make
from stp.sim import Costs, simulate
from stp.sim.predict import predict_emulated


def test_prediction_is_the_simulation_of_the_measured_costs():
    """Units of 6/6/4 ms, 1 ms gathers and scatters, two layers a chunk: the
    prediction is `simulate` of those costs, and chunking ZB-V's lone passes in
    four hides most of what it exposes."""
    sch = make("zb-v", 2, 8)
    kw = dict(layers=2, gather_s=1e-3, scatter_s=1e-3, comm_s=2e-4)
    plain = predict_emulated(sch, (6e-3, 6e-3, 4e-3), **kw)
    n = sch.chunks * 4
    want = simulate(sch, Costs(f=6e-3 * n, b=6e-3 * n, w=4e-3 * n, ag=1e-3 * n, rs=1e-3 * n,
                               comm=2e-4), layers=2)
    assert plain.makespan == pytest.approx(want.makespan)
    chunked = predict_emulated(sch, (6e-3, 6e-3, 4e-3), chunks=4, call_s=1e-4, **kw)
    assert chunked.mode == "both" and chunked.in_layer.chunks == 4
    assert chunked.tp_bubble < 0.5 * plain.tp_bubble
