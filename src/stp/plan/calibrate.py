"""Hardware fitted to measurement: `stp plan --calibrate TRACE.json...`, `--hardware local`.

A trace of `stp train --trace` gives, per global stage, the measured F, B, W
times, the all-reduce lane's time per pass and the send latency
(`stp.costmodel.measured`, what `stp costs` and `--costs-from` read). The
fit, over every trace given (medians, so one slow rank does not decide):

    tp_latency   a trace with tp > 1: an F pass of a stage of L layers runs
                 2 L all-reduces (after attention and after the MLP), one
                 more on the first stage (the vocab-parallel embedding) and
                 three more on the last (the loss's reductions,
                 `stp.costmodel.decoder.costs`), so one takes ar / that; on
                 the small tensors of a
                 calibration run a ring all-reduce is latency-bound, 2 (t-1)
                 steps (`stp.costmodel.hardware`): tp_latency = that / 2(t-1)
    pp_latency   the measured send latency (`comm`)
    efficiency   only where the FLOPs of the traced passes are known (`flops`:
                 F + B + W FLOPs of one microbatch through each stage, which
                 `--hardware local` knows, having chosen the model): achieved
                 FLOP/s over the hardware's peak, from the stages' f + b + w
                 less the all-reduce time they waited for (so trace a
                 schedule without braided blocks, e.g. 1f1b, for this)

    gemm_rows    matmul timings on this machine at rows s, s/2, s/4, s/8
                 (`stp plan --calibrate` and `--hardware local` time them,
                 `gemm_rows_fit`): each size's FLOP/s over the largest's is
                 the matmul efficiency in-layer TP overlap's chunks run at
                 (`stp.costmodel.inlayer`)

Bandwidths are kept from the preset: a calibration run's messages are too
small to measure them. Efficiency per pass kind is one number here (the
cost model has one); the measured F, B, W split is reported, not fitted.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.measured import MAX_TRACE_BYTES, measured_stage_costs
from stp.files import read_json

__all__ = ["Fit", "fit_traces", "calibrated", "gemm_rows_fit", "GEMM_PROBE_ROWS"]

GEMM_PROBE_ROWS = (256, 512, 1024, 2048)
"""Rows the matmul probe times: s = 2048 and its chunks s/K for K = 2, 4, 8."""


def gemm_rows_fit(seconds: Mapping[int, float]) -> tuple[tuple[float, float], ...]:
    """`gemm_rows` points from the time of one matmul at each row count (same
    inner and output widths): FLOP/s at each size over the best FLOP/s, so the
    fastest per row reads 1 (a measured curve may rise and fall: noise on a
    busy machine is kept as measured, capped at 1)."""
    rates = {}
    for rows, sec in sorted(seconds.items()):
        if not (isinstance(sec, int | float) and sec > 0 and rows >= 1):
            raise ValueError(f"matmul timing at {rows!r} rows: {sec!r} is not a positive time")
        rates[rows] = rows / sec
    if not rates:
        raise ValueError("no matmul timing to fit")
    best = max(rates.values())
    return tuple((float(r), min(1.0, rate / best)) for r, rate in rates.items())


class Fit:
    """What a set of traces says about the hardware (module doc)."""

    def __init__(self) -> None:
        self.tp_latency: list[float] = []
        self.pp_latency: list[float] = []
        self.achieved: list[float] = []
        self.gemm_rows: tuple[tuple[float, float], ...] | None = None

    def apply(self, base: HardwareSpec) -> HardwareSpec:
        kw: dict[str, Any] = {}  # replace() takes each field's own type
        if self.gemm_rows:
            kw["gemm_rows"] = self.gemm_rows
        if self.tp_latency:
            kw["tp_latency"] = statistics.median(self.tp_latency)
        if self.pp_latency:
            kw["pp_latency"] = statistics.median(self.pp_latency)
        if self.achieved:
            kw["efficiency"] = min(1.0, statistics.median(self.achieved) / base.peak_flops)
        return replace(base, name=f"{base.name}+calibrated", **kw)


def _read(path: str) -> dict:
    doc = read_json(path, MAX_TRACE_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("otherData"), dict):
        raise ValueError(f"--calibrate {path!r}: not a trace of `stp train --trace`")
    return doc


def fit_traces(paths: Sequence[str], flops: Sequence[float] | None = None) -> Fit:
    """Fit from the traces at `paths`; `flops`: F + B + W FLOPs of one
    microbatch through each global stage of every trace (same stages), or None."""
    fit = Fit()
    for path in paths:
        doc = _read(path)
        try:
            table = measured_stage_costs(doc, repr(path))
        except (KeyError, TypeError) as e:
            raise ValueError(f"--calibrate {path!r}: a trace event lacks a field or holds a "
                             f"bad value ({str(e)[:80]})") from None
        tp = doc["otherData"].get("tp")
        tp = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else 1
        if table.comm > 0:
            fit.pp_latency.append(table.comm / 1e3)
        counts = table.partition or (1,) * len(table.stages)
        last = len(table.stages) - 1
        for i, st in enumerate(table.stages):
            if tp > 1 and st.ar > 0:
                calls = 2 * counts[i] + (i == 0) + 3 * (i == last)
                fit.tp_latency.append(st.ar / calls / (2 * (tp - 1)) / 1e3)
            # A pass's measured time includes the all-reduces it waited for
            # (nothing hides them in an unbraided schedule): compute is the rest.
            busy = max(st.f + st.b + st.w - st.ar - (st.ar_b or 0.0), 0.5 * (st.f + st.b + st.w))
            if flops is not None and i < len(flops) and busy > 0:
                fit.achieved.append(flops[i] / (busy / 1e3))
    if not (fit.tp_latency or fit.pp_latency or fit.achieved):
        raise ValueError(f"--calibrate: {len(paths)} trace(s) hold no all-reduce, send or "
                         "known compute to fit; trace a run with --pp 2 --tp 2")
    return fit


def calibrated(base: HardwareSpec, traces: Sequence[str],
               gemm_seconds: Mapping[int, float] | None = None) -> HardwareSpec:
    """`base` with the fields the traces measure, and with `gemm_seconds` (matmul
    timings at `GEMM_PROBE_ROWS`) its `gemm_rows` (module doc)."""
    fit = fit_traces(traces)
    if gemm_seconds:
        fit.gemm_rows = gemm_rows_fit(gemm_seconds)
    return fit.apply(base)
