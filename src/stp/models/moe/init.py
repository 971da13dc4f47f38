"""The MoE decoder's parameters: the decoder's (stp.models.decoder.init) with each
MoE layer's MLP replaced by a router, E routed experts and an optional shared
expert. Names, shapes and TP shard dims:

    layers.{i}.moe.router.weight          [E, h]    replicated (every rank routes alike)
    layers.{i}.moe.experts.{e}.w1.weight  [f, h]    column-parallel (dim 0)
    layers.{i}.moe.experts.{e}.w3.weight  [f, h]    column-parallel (dim 0)
    layers.{i}.moe.experts.{e}.w2.weight  [h, f]    row-parallel (dim 1)
    layers.{i}.moe.shared.w1/w3/w2.weight           as an expert, width shared_expert_ffn
    layers.{i}.moe.shared_gate.weight     [1, h]    replicated

Experts are TP-sharded like the dense MLP (Megatron-LM's expert tensor
parallelism): an MoE unit then ends in a partial sum over the TP group, one
all-reduce, exactly where the dense MLP unit ends, so braiding hides it the
same way. Values come from the same seeded init as the decoder's
(`init_full`: a parameter's name and the seed fix it whatever the mesh).
"""

from __future__ import annotations

from stp.models.decoder.init import ParamSpec, layer_specs
from stp.shapes.moe import MoEConfig

__all__ = ["moe_layer_specs", "moe_parameter_specs"]


def _swiglu(prefix: str, hidden: int, width: int) -> list[ParamSpec]:
    return [
        ParamSpec(prefix + "w1.weight", (width, hidden), 0, "normal"),
        ParamSpec(prefix + "w3.weight", (width, hidden), 0, "normal"),
        ParamSpec(prefix + "w2.weight", (hidden, width), 1, "normal_out"),
    ]


def moe_layer_specs(config: MoEConfig, layer: int,
                    experts: range | None = None) -> list[ParamSpec]:
    """The parameters of layer `layer`: the decoder's, its MLP routed when it is an
    MoE layer; `experts`: the routed experts held here (expert parallelism; None:
    all), under their global indices."""
    specs = layer_specs(config, layer)
    if not config.is_moe_layer(layer):
        return specs
    p = f"layers.{layer}.moe."
    h = config.hidden
    moe = [ParamSpec(p + "router.weight", (config.num_experts, h), None, "normal")]
    for e in range(config.num_experts) if experts is None else experts:
        moe += _swiglu(f"{p}experts.{e}.", h, config.expert_ffn)
    if config.shared_expert_ffn:
        moe += _swiglu(p + "shared.", h, config.shared_expert_ffn)
        moe.append(ParamSpec(p + "shared_gate.weight", (1, h), None, "normal"))
    dense = f"layers.{layer}.mlp."
    return [s for s in specs if not s.name.startswith(dense)] + moe


def moe_parameter_specs(
    config: MoEConfig, layers: range | None = None, *, first: bool = True, last: bool = True,
    experts: range | None = None,
) -> list[ParamSpec]:
    """As stp.models.decoder.init.parameter_specs, for the MoE decoder (`experts`: the
    routed experts held here, as moe_layer_specs)."""
    layers = range(config.num_layers) if layers is None else layers
    specs: list[ParamSpec] = []
    vocab = (config.vocab_size, config.hidden)
    if first:
        specs.append(ParamSpec("embed.weight", vocab, 0, "normal", "vocab"))
    for i in layers:
        specs.extend(moe_layer_specs(config, i, experts))
    if last:
        specs.append(ParamSpec("norm.weight", (config.hidden,), None, "ones"))
        tied = "embed.weight" if config.tie_embeddings else None
        specs.append(ParamSpec("head.weight", vocab, 0, "normal", "vocab", tied))
    return specs
