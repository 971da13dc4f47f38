"""Dense matmul peaks of the GPUs `stp train` reports its MFU against.

MFU (model FLOPs utilisation) is the model's training FLOPs of a step
(`stp.costmodel.families.model_flops`: matmuls only, attention counted full,
recomputation not counted) over the step time and the devices' dense peak for
the run's dtype (Chowdhery et al., PaLM, arXiv 2204.02311, appendix B).

The peaks are NVIDIA's datasheet figures without sparsity: bfloat16 on the
tensor cores; float32 on the CUDA cores (PyTorch runs float32 matmuls without
TF32 unless told to: `torch.backends.cuda.matmul.allow_tf32` is off by default);
float64 on the FP64 tensor cores. A device is found by a marker in its name as
`torch.cuda.get_device_name()` gives it ("NVIDIA H100 80GB HBM3", "NVIDIA
H200", "NVIDIA A100-SXM4-80GB"); the more specific markers are tried first, so
an "H100 PCIe" is not read as an SXM H100. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEVICE_PEAKS", "HARDWARE_NAMES", "Peak", "check_hardware", "run_peak"]

_SXM5 = {"bfloat16": 989e12, "float32": 67e12, "float64": 67e12}
_NVL = {"bfloat16": 835e12, "float32": 60e12, "float64": 60e12}
_A100 = {"bfloat16": 312e12, "float32": 19.5e12, "float64": 19.5e12}

DEVICE_PEAKS: dict[str, dict[str, float]] = {
    "H100 PCIE": {"bfloat16": 756e12, "float32": 51e12, "float64": 51e12},
    "H100 NVL": _NVL,
    "H200 NVL": _NVL,
    "H100": _SXM5,
    "H200": _SXM5,
    "A100": _A100,
    "A800": _A100,  # the export variant: the A100's compute, slower NVLink
}
"""Name marker (upper case, most specific first) -> dense FLOP/s per dtype."""

HARDWARE_NAMES: dict[str, str] = {
    "h100": "H100", "h100-pcie": "H100 PCIE", "h100-nvl": "H100 NVL", "h200": "H200",
    "h200-nvl": "H200 NVL", "a100": "A100", "a800": "A800",
    # `stp plan` / `stp memory`'s presets name the same cards
    "h100-80g": "H100", "a100-80g": "A100", "a800-80g": "A800",
}
"""`stp train --hardware NAME` -> its row of DEVICE_PEAKS."""


@dataclass(frozen=True)
class Peak:
    """The dense peak one device offers the run's dtype, and where it came from."""

    flops: float
    """FLOP/s."""
    source: str
    """The device or flag it was read from, for the log."""


def _row(device_name: str) -> str | None:
    upper = device_name.upper()
    return next((marker for marker in DEVICE_PEAKS if marker in upper), None)


def check_hardware(text: str) -> None:
    """ValueError (one line) unless `--hardware` names a device of the table or gives
    a dense peak in FLOP/s (a finite number > 0)."""
    if text.lower() in HARDWARE_NAMES:
        return
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not text.isascii() or not math.isfinite(value) or value <= 0:
        raise ValueError(f"--hardware {text!r}: give a device ({', '.join(HARDWARE_NAMES)}) "
                         "or its dense peak for the run's dtype in FLOP/s (e.g. 989e12)")


def run_peak(device_name: str | None, dtype: str, hardware: str | None = None) -> Peak | None:
    """The dense peak MFU is measured against: `hardware` (a device of the table, or a
    peak in FLOP/s) when given, else the row `device_name` (a CUDA device's name; None
    for the CPU) falls in; None when neither says (the CPU, an unknown card, or a
    dtype the table lacks)."""
    if hardware is not None:
        check_hardware(hardware)
        row = HARDWARE_NAMES.get(hardware.lower())
        if row is None:
            return Peak(float(hardware), f"--hardware {hardware}")
        flops = DEVICE_PEAKS[row].get(dtype)
        return None if flops is None else Peak(flops, f"--hardware {hardware}, {dtype}")
    if device_name is None:
        return None
    row = _row(device_name)
    flops = None if row is None else DEVICE_PEAKS[row].get(dtype)
    return None if flops is None else Peak(flops, f"{device_name}, {dtype}")
