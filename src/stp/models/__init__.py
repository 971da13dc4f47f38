"""The model side of the runtime: a Llama / Qwen2-style decoder with
tensor-parallel layers, cut into pipeline stages with a split (B / W) backward.

- `ModelConfig`: the model's shape (stp.models.config).
- `build_stage(config, stage, num_stages, tp_...)`: one stage on one TP rank, a
  PipelineStage (stp.runtime.stage_api) whose `units` a braiding executor can
  drive one all-reduce at a time (stp.models.decoder).
- `build_reference(config, dtype)`: the whole model in one process, same names
  and initial values, for parity tests.
"""

from stp.models.config import ModelConfig
from stp.models.decoder import AttentionUnit, EmbedUnit, LossUnit, MLPUnit, Unit
from stp.models.init import ParamSpec, parameter_specs, stage_layers
from stp.models.reference import ReferenceModel, build_reference
from stp.models.stage import ModelStage, build_stage, check_tp

__all__ = [
    "ModelConfig",
    "ModelStage",
    "build_stage",
    "check_tp",
    "ReferenceModel",
    "build_reference",
    "ParamSpec",
    "parameter_specs",
    "stage_layers",
    "Unit",
    "EmbedUnit",
    "AttentionUnit",
    "MLPUnit",
    "LossUnit",
]
