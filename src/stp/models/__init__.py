"""The model side of the runtime: a Llama / Qwen2-style decoder with
tensor-parallel layers, cut into pipeline stages with a split (B / W) backward.

- `ModelConfig`: the model's shape (stp.shapes.decoder).
- `build_stage(config, StagePlacement(stage, num_stages, tp_...))`: one stage on
  one TP rank (`StagePlacement`, stp.models.placement: where the stage sits in the
  mesh and how it runs), a PipelineStage (stp.runtime.stage_api) whose `units` a
  braiding executor can drive one all-reduce at a time (stp.models.decoder.units).
- `build_reference(config, dtype)`: the whole model in one process, same names
  and initial values, for parity tests.
- `stp.models.hf`: Hugging Face Llama / Qwen2 checkpoints in and out.
"""

from stp.models.decoder.end_units import EmbedUnit, LossUnit
from stp.models.decoder.init import ParamSpec, parameter_specs
from stp.models.decoder.reference import ReferenceModel, build_reference
from stp.models.decoder.stage import ModelStage, build_stage, check_model, check_tp
from stp.models.decoder.units import AttentionUnit, MLPUnit, Unit
from stp.models.placement import StagePlacement
from stp.models.tp.layers import valid_token_ratio
from stp.shapes.decoder import IGNORE_INDEX, ModelConfig, RopeScaling

__all__ = [
    "IGNORE_INDEX",
    "ModelConfig",
    "RopeScaling",
    "valid_token_ratio",
    "ModelStage",
    "StagePlacement",
    "build_stage",
    "check_model",
    "check_tp",
    "ReferenceModel",
    "build_reference",
    "ParamSpec",
    "parameter_specs",
    "Unit",
    "EmbedUnit",
    "AttentionUnit",
    "MLPUnit",
    "LossUnit",
]
