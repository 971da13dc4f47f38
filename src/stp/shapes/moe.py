"""The mixture-of-experts decoder's shape: the decoder (`ModelConfig`: attention,
vocabulary, norms, rotary settings) with some MLPs replaced by a routed set of
SwiGLU experts (Qwen2-MoE, arXiv 2407.10671; Mixtral, arXiv 2401.04088).

An MoE layer: a router (softmax over `num_experts`, the `top_k` largest kept,
renormalised when `norm_topk_prob`), every token sent to its top-k experts
(dropless: no capacity, so nothing is dropped and the model equals
transformers'), their outputs summed with the routing weights, plus an
optional shared expert scaled by a sigmoid gate (Qwen2-MoE). Layer `i` is an
MoE layer when `(i + 1) % moe_every == 0` (transformers' `decoder_sparse_step`);
the others keep the dense SwiGLU MLP of width `ffn_hidden`.

The load-balancing loss (Switch Transformer, arXiv 2101.03961, eqs. 4-6, as
transformers' `load_balancing_loss_func` computes it) is added to the language
model loss with the weight `aux_loss_coef`; see stp.models.moe.routing for how
stp averages it over layers and microbatches.

`MoEConfig` is a `ModelConfig` (a subclass), so every decoder helper that reads
the attention and vocabulary fields takes it as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stp.shapes.decoder import ModelConfig

__all__ = ["HF_MOE_TYPES", "MoEConfig"]

HF_MOE_TYPES = ("qwen2_moe", "mixtral")
"""Hugging Face model types whose weights stp reads and writes (their key layouts)."""


def _int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MoEConfig.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"MoEConfig.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    num_experts: int = 4
    """Routed experts E per MoE layer."""
    top_k: int = 2
    """Experts each token goes to (k <= E)."""
    expert_ffn: int = 64
    """SwiGLU inner width of one routed expert (transformers' moe_intermediate_size;
    Mixtral's intermediate_size)."""
    shared_expert_ffn: int = 0
    """Inner width of the shared expert with its sigmoid gate (Qwen2-MoE); 0: none."""
    moe_every: int = 1
    """Layer i is an MoE layer when (i + 1) % moe_every == 0 (decoder_sparse_step)."""
    norm_topk_prob: bool = True
    """Renormalise the k kept routing probabilities to sum to one (Mixtral: always)."""
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the objective (router_aux_loss_coef)."""
    hf_type: str = "qwen2_moe"
    """The Hugging Face layout the weights are read from and written as."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _int("num_experts", self.num_experts, 1)
        _int("top_k", self.top_k, 1)
        _int("expert_ffn", self.expert_ffn, 1)
        _int("shared_expert_ffn", self.shared_expert_ffn, 0)
        _int("moe_every", self.moe_every, 1)
        if self.num_experts > 1024:
            raise ValueError(f"MoEConfig.num_experts must be <= 1024, got {self.num_experts}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be <= num_experts="
                             f"{self.num_experts} (a token cannot go to more experts than exist)")
        if self.moe_every > self.num_layers:
            raise ValueError(f"MoEConfig.moe_every={self.moe_every} must be <= num_layers="
                             f"{self.num_layers} (otherwise no layer is an MoE layer)")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"MoEConfig.norm_topk_prob must be a bool, got "
                             f"{self.norm_topk_prob!r}")
        coef = self.aux_loss_coef
        if (isinstance(coef, bool) or not isinstance(coef, int | float) or not math.isfinite(coef)
                or coef < 0):
            raise ValueError(f"MoEConfig.aux_loss_coef must be a finite number >= 0, got {coef!r}")
        if self.hf_type not in HF_MOE_TYPES:
            raise ValueError(f"MoEConfig.hf_type must be one of {', '.join(HF_MOE_TYPES)}, got "
                             f"{self.hf_type!r}")
        if self.hf_type == "mixtral" and (self.shared_expert_ffn or self.moe_every != 1
                                          or not self.norm_topk_prob or self.qkv_bias):
            raise ValueError("MoEConfig.hf_type='mixtral' has no shared expert, no q/k/v bias, "
                             "an MoE MLP in every layer and renormalised top-k weights; use "
                             "hf_type='qwen2_moe'")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes its MLP over the experts."""
        return (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers, in order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))
