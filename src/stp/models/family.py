"""What a model family gives the layers above it: one object per family.

stp trains several kinds of model through one runtime: the decoder (Llama /
Qwen2 style), the multimodal model (a vision encoder in front of that
decoder), and whatever a later family adds. Everything above `stp.models`
(the trainer, the `stp train` job, the CLI) reaches a family only through
this protocol, never by testing a config's class, so a new family is its own
package plus one line in the registry (`stp.train.families`); torchtitan's
`ModelSpec` is the precedent.

A family has two halves:
- torch-free: its config dataclass in `stp.shapes` (which the cost model, the
  search and the pure CLI commands may import) and the cost model's spec for it
  (`cost_spec`, a `stp.costmodel` object);
- torch: its stages and its single-process reference, in `stp.models.<family>`.

What only some families offer (expert parallelism, a Hugging Face layout) is in
the protocol too, with the default that stands for its absence; a family class
names `ModelFamily` as its base to take those defaults, so a reader sees here
everything a family may be asked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

__all__ = ["ModelFamily", "StageBuilder", "check_text_batch", "refuse_ep"]

StageBuilder = Callable[..., Any]
"""`builder(stage, num_stages, *, tp_group, tp_size, tp_rank, device, dtype)` -> a
PipelineStage (stp.runtime.stage_api) with `named_parameters()`, `shard_dim(name)`
and `zero_grad()`."""


class ModelFamily(Protocol):
    """The verbs every model family implements (see the module doc)."""

    name: str
    """The family's name, as `stp train --arch` spells it."""
    config_type: type
    """Its config dataclass (in stp.shapes); a config of this exact type belongs to it."""
    hf_refusal: str | None = None
    """Why its model has no Hugging Face layout (one line); None: stp.models.hf
    reads and writes it."""

    def check(self, config: Any, tp: int, num_stages: int) -> None:
        """ValueError (one line) unless `config` splits into `num_stages` pipeline
        stages of `tp` tensor-parallel shards."""

    def num_layers(self, config: Any) -> int:
        """The layers a partition splits over the global stages."""

    def hidden(self, config: Any) -> int:
        """Width of the tensors sent between stages."""

    def parameter_count(self, config: Any) -> int:
        """Every parameter of the whole model, each once (a tied head is its embedding;
        an MoE's routed and shared experts, a multimodal model's encoder and merger
        included): what a checkpoint stores."""

    def stage_builder(self, config: Any, num_stages: int, *,
                      partition: tuple[int, ...] | None,
                      weights: Callable[..., torch.Tensor] | None = None,
                      sequence_parallel: bool = False,
                      recompute: str = "none") -> StageBuilder:
        """The builder of one stage of `num_stages` on one TP rank (ValueError for a
        `partition` that does not cut the model's layers into them); `weights` (a checkpoint's shard
        reader) replaces the seeded initialisation where the family can read one;
        `sequence_parallel` shards the stream between TP regions along the sequence
        (ValueError where the family cannot); `recompute` is the activation
        recomputation, none / selective / full (stp.models.recompute; ValueError where
        the family cannot)."""

    def check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """ValueError unless (tokens, targets) is a global batch this family trains on."""

    def reference(self, config: Any, dtype: torch.dtype) -> torch.nn.Module:
        """The whole model in one process, with the stages' names and initial values."""

    def cost_spec(self, config: Any, *, sequence: int, micro_batch: int, tp: int) -> Any:
        """The cost model's view (stp.costmodel) of `config` trained on microbatches of
        `micro_batch` samples of `sequence` tokens, on `tp` tensor-parallel ranks."""

    def shared_grads(self, config: Any, stages: Mapping[int, Any], schedule: Any,
                     mesh: Any) -> Callable[[dict[str, torch.Tensor]], None] | None:
        """What sums the gradients of parameters held in more than one place (a tied
        embedding and head, replicated kv heads); None when nothing is shared."""

    def check_ep(self, config: Any, ep: int) -> None:
        """ValueError (one line) unless `config`'s experts split over `ep` expert-parallel
        ranks. The default, a model without experts: only ep 1."""
        refuse_ep(ep)

    def describe(self, config: Any, *, params: str, ep: int) -> str:
        """The model in a few words for a run's summary (`params`: its parameter count,
        written out); the default: layers x width."""
        return f"{self.num_layers(config)}x{self.hidden(config)} ({params} params)"

    def builder_on_mesh(self, builder: StageBuilder, mesh: Any) -> StageBuilder:
        """`builder` given what it needs of the mesh beyond its TP group (a mixture of
        experts: its expert-parallel group). The default: nothing more."""
        return builder


def refuse_ep(ep: int) -> None:
    """ValueError for ep > 1 on a model without experts (the message every such model gives)."""
    if ep != 1:
        raise ValueError(f"--ep {ep}: expert parallelism needs a mixture-of-experts model "
                         "(--arch moe, or a Qwen2-MoE / Mixtral --init-from); use --ep 1")


def check_text_batch(tokens: torch.Tensor, targets: torch.Tensor) -> None:
    """The batch rule of a text model (and of a user's stage builder): token ids and
    their targets, both [B, s]."""
    if tokens.dim() != 2 or tokens.shape != targets.shape:
        raise ValueError(
            f"batch needs tokens and targets of one shape [B, s], got {tuple(tokens.shape)} "
            f"and {tuple(targets.shape)}"
        )
