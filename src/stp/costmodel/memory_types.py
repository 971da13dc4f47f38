"""The bytes-per-rank model's inputs and results: the mesh and batch (`Layout`),
what changes the bytes (`Features`), one pipeline rank's bytes by category
(`RankMemory`) and the whole estimate (`MemoryEstimate`). The model itself,
and what each category counts, is stp.costmodel.memory."""

from __future__ import annotations

from dataclasses import dataclass

from stp.costmodel.decoder.spec import RECOMPUTE_MODES
from stp.schedule.offload import parse_policy
from stp.schedule.registry import SCHEDULES

__all__ = ["CATEGORIES", "DTYPE_BYTES", "RUNTIMES", "Features", "Layout", "MemoryEstimate",
           "RankMemory"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
CATEGORIES = ("weights", "grads", "masters", "optimizer", "activations_peak", "buffers")
RUNTIMES = ("megatron", "stp")


@dataclass(frozen=True)
class Layout:
    """How a step is cut: the mesh, the batch and the schedule."""

    pp: int
    tp: int = 1
    dp: int = 1
    microbatches: int = 1
    microbatch_size: int = 1
    seq_len: int = 4096
    schedule: str = "stp"
    partition: tuple[int, ...] | None = None
    """Layers per global stage (None: the even split, `stp.sim.layered`)."""
    ep: int | None = None
    """Expert-parallel ranks of a mixture of experts, carved from the dp ranks (ep
    divides dp). None: the model spec's own `ep` where it divides dp, else 1 (noted)."""
    chunks: int | None = None
    """Stages per rank of a schedule that takes them (1f1b-interleaved,
    zb-interleaved, looped-bfs; `--chunks`); None: the generator's default."""

    def __post_init__(self) -> None:
        if self.ep is not None:
            if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
                raise ValueError(f"ep={self.ep!r} must be an integer >= 1")
            if self.dp % self.ep:
                raise ValueError(f"ep={self.ep} must divide dp={self.dp} (the expert-parallel "
                                 "group is carved from the data-parallel ranks)")
        for key in ("pp", "tp", "dp", "microbatches", "microbatch_size", "seq_len",
                    *(("chunks",) if self.chunks is not None else ())):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{key}={val!r} must be an integer >= 1")
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))
            if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                       for c in self.partition):
                raise ValueError(f"partition {self.partition}: layer counts >= 1 expected")
        gen = SCHEDULES.get(self.schedule)
        if self.chunks is not None and gen is not None and not gen.takes_chunks:
            raise ValueError(f"chunks={self.chunks}: {self.schedule} takes no chunks; "
                             f"{', '.join(n for n, g in SCHEDULES.items() if g.takes_chunks)}"
                             " do")


@dataclass(frozen=True)
class Features:
    """What a run turns on that changes its memory."""

    dtype: str = "bfloat16"
    sequence_parallel: bool = False
    recompute: str = "none"
    shard_optimizer: bool = False
    offload: str = "none"
    """An offload policy of `stp.sim.offload` (none, stp, all, selective:X)."""
    runtime: str = "megatron"
    """Whose activations: `megatron` (Korthikanti's formulas, stp.costmodel.decoder.spec)
    or `stp` (what stp's own decoder units keep, stp.costmodel.decoder.kept: the
    estimate of a `stp train` run)."""
    overlap_grad_sync: bool = True
    """Each stage's DP gradient reduction launched as soon as its gradients are final
    (`stp train --overlap-grad-sync`): its flat copy, where there is one, is held
    during the last backwards (module doc)."""
    braid: bool = True
    """Braided blocks braid their passes (`--braid on`); False runs them pass by pass."""
    tp_overlap_chunks: int = 0
    """In-layer TP overlap (`--tp-overlap --tp-overlap-chunks K`): K chunks per unit
    on passes that run alone (`stp.sim.inlayer`); 0: off. Needs sequence parallelism."""

    def __post_init__(self) -> None:
        k = self.tp_overlap_chunks
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"--tp-overlap-chunks {k!r}: an integer >= 1")
        if k and not self.sequence_parallel:
            raise ValueError("--tp-overlap needs --sequence-parallel (it chunks the "
                             "all-gathers and reduce-scatters sequence parallelism runs)")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime {self.runtime!r}: choose one of {', '.join(RUNTIMES)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute {self.recompute!r}: choose one of "
                             f"{', '.join(RECOMPUTE_MODES)}")
        parse_policy(self.offload)  # ValueError naming the policy

    @property
    def sixteen_bit(self) -> bool:
        return DTYPE_BYTES[self.dtype] == 2


@dataclass(frozen=True)
class RankMemory:
    """Bytes one pipeline rank (each of its TP and DP peers) holds at its peak."""

    rank: int
    parameters: int
    weights: float
    grads: float
    masters: float
    optimizer: float
    activations_peak: float
    buffers: float
    copies: float = 0.0
    """Of `buffers`, what the DP reductions' flat gradient copies add to the
    activations' peak (module doc; `stp train --json`'s measured `dp_copies`)."""

    def __post_init__(self) -> None:
        for key in ("rank", "parameters", *CATEGORIES, "copies"):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, int | float) or not val >= 0:
                raise ValueError(f"rank memory {key}={val!r} must be a number >= 0")

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in CATEGORIES)

    @property
    def largest(self) -> str:
        return max(CATEGORIES, key=lambda k: getattr(self, k))

    def to_json(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {k: getattr(self, k) for k in CATEGORIES}
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class MemoryEstimate:
    ranks: tuple[RankMemory, ...]
    layout: Layout
    features: Features
    notes: tuple[str, ...] = ()
    step_time: float | None = None
    """The simulated step (makespan) the activations came from, in the cost
    model's milliseconds."""

    @property
    def peak(self) -> RankMemory:
        """The rank with the largest total (the first of equals)."""
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    def to_json(self) -> dict[str, object]:
        return {"memory": self.peak.to_json(), "peak_rank": self.peak.rank,
                "ranks": [{"rank": r.rank, "parameters": r.parameters, **r.to_json(),
                           "dp_copies": r.copies} for r in self.ranks],
                "notes": list(self.notes), "step_ms": self.step_time}
