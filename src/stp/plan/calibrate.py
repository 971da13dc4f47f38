"""Hardware fitted to measurement: `stp plan --calibrate TRACE.json...`, `--hardware local`.

Not available in this build yet: both are refused in one line (see the
README's `stp plan` section for what is planned).
"""

from __future__ import annotations

from collections.abc import Sequence

from stp.costmodel.hardware import HardwareSpec

__all__ = ["calibrated", "local_hardware"]


def calibrated(base: HardwareSpec, traces: Sequence[str]) -> HardwareSpec:
    raise ValueError("--calibrate is not implemented in this build; give the hardware's "
                     "fields instead (--hardware h100-80g,efficiency=0.4,tp_bandwidth=..)")


def local_hardware() -> HardwareSpec:
    raise ValueError("--hardware local is not implemented in this build; give a preset "
                     "(a100-80g, a800-80g, h100-80g) with fields")
