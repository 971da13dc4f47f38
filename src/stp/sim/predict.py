"""The simulator's prediction of a `stp bench fidelity`-style run with in-layer
TP overlap: pp 2 x tp 2 on emulated stages, costs measured per unit.

`stp bench fidelity` times each unit's collectives and the point-to-point send
on the machine, runs the schedules on emulated compute and compares the
measured step with `simulate` under the same costs. `predict_emulated` is that
prediction for a run with sequence parallelism and `--tp-overlap
--tp-overlap-chunks K`: every F/B unit of a pass on its own is cut into K
chunks (`stp.sim.inlayer`), its all-gather and reduce-scatter measured per
unit (`gather_s`, `scatter_s`), `call_s` what one more (smaller) collective call
costs over the whole one, and no matmul efficiency lost (emulated compute waits
the same per row at any size). `launch_s` is the compute stream's own launch
cost after each F and B unit, as `stp bench fidelity` charges it, once per
chunk here (a chunked unit issues K collective pieces of each kind).
"""

from __future__ import annotations

from stp.schedule.ir import Schedule
from stp.sim.costs import Costs
from stp.sim.engine import simulate
from stp.sim.inlayer import InLayer
from stp.sim.result import SimResult

__all__ = ["predict_emulated"]


def predict_emulated(schedule: Schedule, unit_s: tuple[float, float, float], *, layers: int,
                     gather_s: float, scatter_s: float, comm_s: float, launch_s: float = 0.0,
                     chunks: int = 0, call_s: float = 0.0, braid: bool = True,
                     efficiency: float = 1.0) -> SimResult:
    """Seconds of one step of `schedule` (module doc); `unit_s`: the emulated F, B,
    W time of one unit; `chunks` 0: no in-layer overlap; `efficiency`: a unit's
    time over K times one chunk's (1: a chunk takes 1/K of the unit; a measured
    value where waits cut in K pieces cost more than one, as on a loaded machine)."""
    n = schedule.chunks * 2 * layers  # units per microbatch per rank share
    f, b, w = unit_s
    launches = launch_s * max(1, chunks)
    costs = Costs(f=(f + launches) * n, b=(b + launches) * n, w=w * n, ag=gather_s * n,
                  rs=scatter_s * n, comm=comm_s)
    plan = InLayer(chunks, call_s, efficiency) if chunks else None
    return simulate(schedule, costs, layers=layers, record_spans=False, braid=braid,
                    in_layer=plan)
