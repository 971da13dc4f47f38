"""MFU of a `stp train` run: the model's training FLOPs of a step over the step time
and the dense peak of every device of the mesh for the run's dtype.

The FLOPs are the ones `stp plan` reports its MFU with
(`stp.costmodel.families.model_flops`: matmuls only, F, B and W of every layer and
of the output layer; attention counted full, `4 s^2 b h` a forward, not halved
for the causal mask; recomputation not counted, so `--recompute` lowers the MFU
of the same model). The peak is `--hardware`'s, or the table's row for
`torch.cuda.get_device_name()` (stp.costmodel.peaks); on the CPU it is unknown
and the MFU is None (`null` in --json).
"""

from __future__ import annotations

import torch

from stp.costmodel.families import model_flops
from stp.costmodel.peaks import Peak, run_peak
from stp.train.run.resolve import Run

__all__ = ["mfu", "step_flops", "device_peak", "unknown_peak_line"]


def step_flops(run: Run) -> float | None:
    """Model FLOPs of one optimizer step of `run` (stp.train.run.resolve.Run) over the
    whole mesh: every microbatch of every DP replica; None for emulated compute."""
    job = run.job
    if job.emulate is not None:
        return None
    spec = run.family.model.cost_spec(run.config, sequence=job.model.seq_len,
                                      micro_batch=job.microbatch_size, tp=1)
    return model_flops(spec) * job.dp * job.num_microbatches


def device_peak(device: torch.device, dtype: str, hardware: str | None) -> Peak | None:
    """The dense peak of one of the run's devices (stp.costmodel.peaks.run_peak)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return run_peak(name, dtype, hardware)


def mfu(flops: float | None, step_s: float, devices: int, peak: Peak | None) -> float | None:
    """flops / (step_s x devices x peak); None when the FLOPs or the peak are unknown."""
    if flops is None or peak is None or step_s <= 0:
        return None
    return flops / (step_s * devices * peak.flops)


def unknown_peak_line(device: str, dtype: str, emulated: bool) -> str:
    """What the log says instead of an MFU."""
    if emulated:
        return "MFU: none (emulated compute runs no model FLOPs)"
    return (f"MFU: unknown, no dense {dtype} peak known for {device} (give --hardware NAME or "
            "the peak in FLOP/s)")
