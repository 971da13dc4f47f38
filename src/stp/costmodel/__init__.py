"""Costs from model and hardware: FLOPs, activation bytes, link times. Imports no torch."""

from stp.costmodel.decoder.spec import (
    ModelSpec,
    layer_activation_bytes,
    layer_flops,
    num_parameters,
)
from stp.costmodel.derive import Derived, derive, parse_hardware, parse_model
from stp.costmodel.hardware import HardwareSpec, allreduce_time, p2p_time
from stp.costmodel.mllm.spec import MLLM_MODELS, MLLMSpec
from stp.costmodel.presets import HARDWARE, MODELS, STP_REPORTED, ZB_BUBBLE_RATES, ZB_PROFILED

__all__ = [
    "HARDWARE",
    "MLLM_MODELS",
    "MODELS",
    "STP_REPORTED",
    "ZB_BUBBLE_RATES",
    "ZB_PROFILED",
    "Derived",
    "HardwareSpec",
    "MLLMSpec",
    "ModelSpec",
    "allreduce_time",
    "derive",
    "layer_activation_bytes",
    "layer_flops",
    "num_parameters",
    "p2p_time",
    "parse_hardware",
    "parse_model",
]
