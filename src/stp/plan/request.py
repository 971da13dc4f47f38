"""What a user asks `stp plan`: a model, a cluster and a batch.

A request is validated once, here: every number an integer in its range,
the model a decoder spec, the hardware a spec with a known device memory or
an explicit budget. The planner (`stp.plan.planner`) trusts it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from stp.costmodel.decoder.spec import ModelSpec, decoder_only
from stp.costmodel.hardware import HardwareSpec

__all__ = ["PlanRequest", "MAX_GPUS", "MAX_GLOBAL_BATCH", "MAX_SEQ_LEN"]

MAX_GPUS = 1 << 20
MAX_GLOBAL_BATCH = 1 << 24
MAX_SEQ_LEN = 1 << 20


def _int_in(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r}: an integer from {lo} to {hi} expected")


def _check_ep(model: ModelSpec, ep: tuple[int, ...]) -> None:
    """`--ep`: sizes a mixture of experts' experts divide (one line naming them)."""
    if not ep:
        raise ValueError("--ep: give expert-parallel sizes separated by commas")
    for n in ep:
        _int_in("--ep", n, 1, MAX_GPUS)
    if not model.has_experts:
        if set(ep) != {1}:
            raise ValueError(f"--ep {','.join(map(str, ep))}: expert parallelism needs a "
                             f"mixture-of-experts model; {model.name} has no experts")
        return
    fits = model.ep_sizes()  # the divisors of its experts, the last all of them
    bad = [n for n in ep if n not in fits]
    if bad:
        raise ValueError(f"--ep {bad[0]}: must divide the model's {fits[-1]} experts "
                         f"(each expert-parallel rank holds experts / ep); accepted: "
                         f"{', '.join(map(str, fits))}")


@dataclass(frozen=True)
class PlanRequest:
    """A model on a cluster with a global batch; what `stp plan` answers."""

    model: ModelSpec
    """The decoder to train (its sequence and tp fields are replaced per plan)."""
    hardware: HardwareSpec
    """One GPU and its links (a preset, a calibrated one, or given field by field)."""
    gpus: int
    """GPUs in the cluster: every plan uses all of them (pp x tp x dp)."""
    global_batch: int
    """Sequences per optimizer step over all replicas."""
    seq_len: int
    """Tokens per sequence."""
    gpus_per_node: int = 8
    """GPUs joined by the fast link: tensor parallelism stays within a node."""
    memory_budget: float | None = None
    """Bytes one GPU may hold; None: the hardware's device memory."""
    top: int = 5
    """Plans reported."""
    dtype: str = "bfloat16"
    """Compute dtype of the runs planned (fp32 master weights when 16-bit)."""
    max_microbatch_size: int = 8
    """Largest microbatch size tried (sequences per microbatch)."""
    schedules: tuple[str, ...] | None = None
    """Schedules considered (None: every registered one)."""
    partition: str = "auto"
    """`auto`: the best rows also try `--partition auto`; `even`: never."""
    allow_sequence_parallel: bool = True
    """Whether sequence parallelism may be turned on to fit memory."""
    allow_offload: bool = True
    """Whether activation offload may be turned on to fit memory."""
    tp_overlap: bool = True
    """Whether the top plans try the other TP overlap modes (braiding off,
    in-layer overlap, both: `stp.plan.overlap`)."""
    ep: tuple[int, ...] | None = None
    """Expert-parallel sizes considered for a mixture of experts (None: every
    divisor of dp that divides the experts, `stp.plan.space.ep_options`)."""
    source: str | None = None
    """How the user named the model, for the `stp train --model` of every row: a
    preset (with its fields) or a config.json's absolute path; None: the rows
    name no model."""
    source_sha256: str | None = None
    """The sha256 of that config.json (None for a preset), which `stp train --plan`
    checks before training."""

    def __post_init__(self) -> None:
        try:
            decoder_only(self.model, "stp plan")
        except ValueError:
            raise ValueError("stp plan covers decoder models; give a decoder preset or a "
                             "config.json") from None
        _int_in("--gpus", self.gpus, 1, MAX_GPUS)
        _int_in("--global-batch", self.global_batch, 1, MAX_GLOBAL_BATCH)
        _int_in("--seq-len", self.seq_len, 1, MAX_SEQ_LEN)
        _int_in("--gpus-per-node", self.gpus_per_node, 1, 1024)
        _int_in("--top", self.top, 1, 1000)
        _int_in("max microbatch size", self.max_microbatch_size, 1, 1 << 16)
        if self.partition not in ("auto", "even"):
            raise ValueError(f"--partition {self.partition!r}: choose auto or even")
        if self.memory_budget is None and not self.hardware.memory:
            raise ValueError(f"hardware {self.hardware.name!r} does not say its device memory; "
                             "give --memory-budget SIZE or memory=BYTES in --hardware")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ValueError(f"--memory-budget {self.memory_budget!r} must be > 0 bytes")
        if self.ep is not None:
            _check_ep(self.model, self.ep)

    @property
    def budget(self) -> float:
        """Bytes one GPU may hold."""
        return self.memory_budget if self.memory_budget is not None else self.hardware.memory
