"""The shapes of stp's model families: plain, validated dataclasses, no torch.

Every layer may import this package (like `stp.files`): the runtime's model
builders, the cost model, the search, the trainer and the CLI all read one
`ModelConfig` (decoder) or `MLLMConfig` (vision encoder + decoder) instead of
copying its fields under other names.
"""

from stp.shapes.decoder import IGNORE_INDEX, ModelConfig, RopeScaling, default_ffn_hidden
from stp.shapes.mllm import MLLMConfig, VisionConfig
from stp.shapes.moe import MoEConfig

__all__ = ["IGNORE_INDEX", "ModelConfig", "RopeScaling", "default_ffn_hidden", "MLLMConfig",
           "MoEConfig", "VisionConfig"]
