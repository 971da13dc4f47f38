"""The contract between the executor and a model chunk (one pipeline stage).

The executor (stp.runtime.executor) interprets a schedule's lowered action
lists and calls these methods; the model side (stp.models) implements them
with tensor-parallel layers whose collectives run on the TP group. Keeping the
contract this small is what lets one interpreter run every schedule
(one interpreter, as DualPipe runs every schedule with a handful of chunk
primitives).

Microbatch bookkeeping lives in the stage: `forward(mb, ...)` stores what the
backward of `mb` needs; `backward_input(mb, ...)` consumes it and stores what
`backward_weight(mb)` needs (the split backward of "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, section 2: B computes input gradients only,
W the weight gradients, later).

A stage may also be cut into units (`UnitStage`: attention, MLP, embedding,
loss), each F or B unit ending in a TP all-reduce that the runtime launches
and waits for, so braided blocks can interleave two passes unit by unit
(stp.runtime.braid). `as_unit_stage` presents a stage that is not cut as a
stage of one unit with nothing to reduce, so the executor has one path.

Beyond the four passes a stage may offer more (`StageOffers` lists every
member): its expert parameters, which microbatches run a full backward, the
tensors a microbatch keeps, its parameters' full shapes and shards. A user's
stage builder offers none of it; the functions below the protocol read each
member with the default that stands for its absence, so no layer above probes a
stage for what it might have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["PipelineStage", "StageOffers", "TrainableStage", "Unit", "UnitStage", "as_unit_stage",
           "check_input", "expert_names", "full_shape", "kept_tensors", "offers_aux",
           "prepares_gathers", "reset", "shard_slice", "shared_tensors", "stage_units",
           "take_gathers", "ties_head_to_embedding", "unshard", "weights_in_backward"]


@runtime_checkable
class PipelineStage(Protocol):
    stage: int
    """Global stage index this object runs."""
    is_first: bool
    """Holds the embedding: `forward` takes token ids."""
    is_last: bool
    """Holds the head and loss: `forward` takes targets and returns the loss."""

    def forward(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F. First stage: x = token ids [b, s]; otherwise hidden states [b, s, h].
        Last stage: returns this microbatch's mean loss (a 0-dim tensor, detached);
        otherwise the output hidden states (detached, ready to send)."""
        ...

    def backward_input(
        self, mb: int, grad: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor | None:
        """B: input gradient only. `grad` is the output gradient (None on the last
        stage, whose loss gradient is `scale`). Returns the input gradient (None on
        the first stage). Weight gradients are deferred until backward_weight."""
        ...

    def backward_weight(self, mb: int) -> None:
        """W: accumulate this microbatch's weight gradients into `.grad`."""
        ...

    def backward_full(
        self, mb: int, grad: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor | None:
        """BW: B immediately followed by W."""
        ...


@runtime_checkable
class Unit(Protocol):
    """One unit of a stage (an attention or MLP block, the embedding, the loss).

    Each F and B step is split at its TP all-reduce: `*_partial` returns the
    partial sum to reduce over the TP group (None: nothing to reduce), and
    `*_finish` takes the reduced tensor and returns the unit's output. W needs
    no all-reduce.
    """

    def forward_partial(
        self, mb: int, x: Any, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None: ...

    def forward_finish(self, mb: int, reduced: torch.Tensor | None) -> Any: ...

    def backward_partial(self, mb: int, grad: Any) -> torch.Tensor | None:
        """`grad`: the output gradient; on the last stage's loss unit, the loss
        gradient's scale as a 0-dim tensor."""
        ...

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None: ...

    def weight(self, mb: int) -> None: ...

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        """Before its forward, with the previous unit's output: launch what it will wait
        for (sequence parallelism's all-gather); most units do nothing."""
        ...

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        """As prepare_forward, before its backward, with the output gradient."""
        ...


@runtime_checkable
class UnitStage(Protocol):
    """A pipeline stage cut into units (stp.models.ModelStage, stp.models.emulated)."""

    stage: int
    is_first: bool
    is_last: bool
    units: Sequence[Unit]

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the TP sum of `partial`: (the tensor that will hold the sum, the
        work to wait on, None when there is nothing to wait for)."""
        ...

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None: ...


class _WholePass:
    """A stage's whole pass as one unit with nothing to reduce."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self._out: dict[int, Any] = {}

    def forward_partial(self, mb: int, x: Any, targets: torch.Tensor | None = None) -> None:
        self._out[mb] = self.stage.forward(mb, x, targets)

    def forward_finish(self, mb: int, reduced: torch.Tensor | None) -> Any:
        return self._out.pop(mb)

    def backward_partial(self, mb: int, grad: Any) -> None:
        st = self.stage
        if st.is_last:  # the runner seeds the loss unit with the scale
            self._out[mb] = st.backward_input(mb, None, float(grad))
        else:
            self._out[mb] = st.backward_input(mb, grad)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        return self._out.pop(mb)

    def weight(self, mb: int) -> None:
        self.stage.backward_weight(mb)

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        pass  # a whole pass gathers nothing ahead

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        pass


class _OneUnitStage:
    """`stage` seen as a UnitStage of one unit (see `as_unit_stage`)."""

    def __init__(self, stage: PipelineStage) -> None:
        self.inner = stage
        self.stage, self.is_first, self.is_last = stage.stage, stage.is_first, stage.is_last
        self.units: Sequence[Unit] = (_WholePass(stage),)

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise AssertionError("a whole-pass unit has nothing to reduce")

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        check_input(self.inner, x, targets)


def as_unit_stage(stage: PipelineStage) -> UnitStage:
    """`stage` itself when it is cut into units, else a one-unit view of it: a
    full backward then runs as B followed by W, which is what `backward_full`
    means, so the executor needs no pass-level path."""
    if isinstance(stage, UnitStage):
        return stage
    return _OneUnitStage(stage)


class TrainableStage(PipelineStage, Protocol):
    """A stage the trainer optimizes and checkpoints (what a stage builder returns)."""

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def shard_dim(self, name: str) -> int | None:
        """The dim parameter `name` is split along over the TP ranks; None: replicated."""
        ...

    def zero_grad(self) -> None: ...


class StageOffers(Protocol):
    """What a stage may offer beyond `PipelineStage`, each member optional; the
    function of the same name below reads it, or gives its default."""

    expert_names: frozenset[str]
    """Its parameters held by this expert-parallel rank only (default: none)."""
    units: Sequence[Unit]
    """Its units (stp.models.unit; default: none, a stage of the user's own)."""
    specs: Mapping[str, Any]
    """Parameter name -> its spec, whose `.shape` is the full (unsharded) shape."""
    prepares_gathers: bool
    """Its units launch all-gathers before their pass (sequence parallelism)."""
    config: Any
    """Its model's config (`tie_embeddings`: the head is the embedding)."""

    def weights_in_backward(self, mbs: Iterable[int]) -> None:
        """Told once: the microbatches whose backward runs as one full BW."""

    def kept_tensors(self, mb: int) -> list[torch.Tensor]:
        """The tensors microbatch `mb`'s forward keeps for its backward (offload)."""

    def shared_tensors(self) -> list[torch.Tensor]:
        """Tensors every microbatch uses beyond the parameters (never offloaded)."""

    def parameters(self) -> Iterable[torch.Tensor]: ...

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        """ValueError for an input this stage cannot take."""

    def take_gathers(self) -> list[tuple[float, float, float]]:
        """(start, end, exposed seconds) of the all-gathers since the last call."""

    def take_aux(self) -> Any:
        """Its auxiliary loss terms since the last call (a mixture of experts)."""

    def reset(self) -> None:
        """Forget what forwards without backwards (evaluation) left behind."""

    def shard_slice(self, name: str) -> Any:
        """Where this TP rank's shard of `name` sits in the full tensor."""

    def unshard(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every TP rank's shard (padding, replicated heads)."""


def _offered(stage: object, member: str) -> Any:
    """`stage`'s member of StageOffers, or None where it offers none: the one place
    that asks a stage what it has."""
    return getattr(stage, member, None)


def expert_names(stage: object) -> frozenset[str]:
    return frozenset(_offered(stage, "expert_names") or ())


def stage_units(stage: object) -> Sequence[Unit]:
    return tuple(_offered(stage, "units") or ())


def full_shape(stage: object, name: str) -> tuple[int, ...] | None:
    """The full (unsharded) shape of parameter `name`; None where the stage gives no spec."""
    spec = (_offered(stage, "specs") or {}).get(name)
    return None if spec is None else tuple(spec.shape)


def prepares_gathers(stage: object) -> bool:
    return bool(_offered(stage, "prepares_gathers"))


def ties_head_to_embedding(stage: object) -> bool:
    return bool(getattr(_offered(stage, "config"), "tie_embeddings", False))


def weights_in_backward(stage: object, mbs: Iterable[int]) -> None:
    tell = _offered(stage, "weights_in_backward")
    if callable(tell):
        tell(mbs)


def kept_tensors(stage: object) -> Callable[[int], list[torch.Tensor]] | None:
    """The stage's `kept_tensors`; None where it has none (offload needs it)."""
    kept = _offered(stage, "kept_tensors")
    return kept if callable(kept) else None


def shared_tensors(stage: object) -> list[torch.Tensor]:
    """Its parameters and shared tensors (either may be absent)."""
    params, shared = _offered(stage, "parameters"), _offered(stage, "shared_tensors")
    return [*(params() if callable(params) else ()), *(shared() if callable(shared) else ())]


def check_input(stage: object, x: torch.Tensor, targets: torch.Tensor | None) -> None:
    check = _offered(stage, "check_input")
    if check is not None:
        check(x, targets)


def take_gathers(stage: object) -> list[tuple[float, float, float]]:
    take = _offered(stage, "take_gathers")
    return [] if take is None else list(take())


def offers_aux(stage: object) -> bool:
    return callable(_offered(stage, "take_aux"))


def reset(stage: object) -> None:
    forget = _offered(stage, "reset")
    if forget is not None:
        forget()


def shard_slice(stage: object, name: str) -> Any:
    """Where this rank's shard of `name` sits; None where the stage does not say."""
    where = _offered(stage, "shard_slice")
    return None if where is None else where(name)


def unshard(stage: object, name: str, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full tensor of `name` from its TP shards: the stage's own `unshard`, else
    the shards end to end along `dim`."""
    join = _offered(stage, "unshard")
    return join(name, parts) if join is not None else torch.cat(parts, dim=dim)
