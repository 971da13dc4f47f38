"""Parameters under their global dotted names (`layers.3.attn.wq.weight`): the
stages, the references and the torch peer all name a parameter as a
checkpoint does, through plain container modules."""

from __future__ import annotations

from torch import nn

__all__ = ["register_dotted"]


def register_dotted(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register `param` under its dotted stage name (`layers.3.attn.wq.weight`) in
    `root`, through plain container modules made on the way, so that a model
    written apart from the stages still has their parameter names."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]  # type: ignore[assignment]  # add_module just made it
    module.register_parameter(leaf, param)
