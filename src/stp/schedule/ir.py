"""The schedule IR: passes, braided blocks, per-rank action lists.

Every layer of stp reads the same `Schedule` object: the validator, the
simulator, the pictures, the exporters and the runtime. Nothing schedules by
control flow elsewhere: a schedule that exists only as control flow inside a
runtime cannot be simulated, validated or drawn before it runs.

Text form follows `torch.distributed.pipelining` action strings so a schedule
can be exchanged with PyTorch:

    0F3                      forward of stage 0, microbatch 3
    2I1                      input-gradient backward (our B) of stage 2, mb 1
    2W1                      weight-gradient backward (W)
    1B0                      full backward (our BW: B then W)
    (0F7;7I3)OVERLAP_F_B     a braided block ("Synergistic Tensor and
                             Pipeline Parallelism", arXiv 2510.27257)

Stages are global (virtual) stage indices; which rank holds a stage is the
schedule's placement (`stage_to_rank`). Reading the text back (`parse_action`,
`from_rows`) is `stp.schedule.io`'s: PyTorch's letters are not our names
(`Kind.B` is "I", `Kind.BW` is "B"), so only the exchange module turns a
letter into a `Kind`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

__all__ = [
    "Kind",
    "Done",
    "Pass",
    "Block",
    "Action",
    "Schedule",
    "passes_of",
    "format_action",
    "looped_placement",
    "v_placement",
    "drop_microbatches",
    "looped_schedule",
    "v_schedule",
]


class Kind(StrEnum):
    """Kind of a compute pass. The value is PyTorch's one-letter code."""

    F = "F"  # forward
    B = "I"  # input-gradient backward (Zero Bubble's B); PyTorch calls it I
    W = "W"  # weight-gradient backward
    BW = "B"  # full backward: B immediately followed by W; PyTorch's B

    @property
    def label(self) -> str:
        """Our own name for the kind (F, B, W, BW), used in messages and pictures."""
        return self.name


class Done(NamedTuple):
    """One result a pass completes: the forward output (`Kind.F`), the input
    gradient (`Kind.B`) or the weight gradient (`Kind.W`) of microbatch `mb`
    at global stage `stage`. A full backward (`Kind.BW`) completes two, B and
    W, so `kind` is never `Kind.BW`; a hashable key for "has this run yet"."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.label}(stage {self.stage}, mb {self.mb})"


_PROVIDES: dict[Kind, tuple[Kind, ...]] = {
    Kind.F: (Kind.F,),
    Kind.B: (Kind.B,),
    Kind.W: (Kind.W,),
    Kind.BW: (Kind.B, Kind.W),
}


@dataclass(frozen=True, slots=True, order=True)
class Pass:
    """One pass of one microbatch through one stage (a model chunk)."""

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    def provides(self) -> tuple[Kind, ...]:
        """The kinds of result this pass completes: F, B or W; (B, W) for BW."""
        return _PROVIDES[self.kind]

    def completes(self) -> tuple[Done, ...]:
        """The results this pass completes, as `Done` keys."""
        return tuple(Done(self.stage, k, self.mb) for k in _PROVIDES[self.kind])

    def needs(self, num_stages: int) -> tuple[Done, ...]:
        """The results this pass waits for, on a pipeline of `num_stages`
        global stages ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241,
        section 2): F(s) after F(s-1); B or BW(s) after F(s) and after the
        input gradient of s+1; W(s) after B(s). The first forward and the
        last stage's backward start the chains."""
        s, i = self.stage, self.mb
        if self.kind is Kind.F:
            return (Done(s - 1, Kind.F, i),) if s > 0 else ()
        if self.kind is Kind.W:
            return (Done(s, Kind.B, i),)
        if s < num_stages - 1:
            return (Done(s, Kind.F, i), Done(s + 1, Kind.B, i))
        return (Done(s, Kind.F, i),)

    @property
    def is_forward(self) -> bool:
        return self.kind is Kind.F

    @property
    def frees_input_grad(self) -> bool:
        """True for passes that produce the input gradient (B or BW)."""
        return self.kind in (Kind.B, Kind.BW)

    @property
    def has_weight_grad(self) -> bool:
        return self.kind in (Kind.W, Kind.BW)


@dataclass(frozen=True, slots=True)
class Block:
    """A braided execution block: passes of different microbatches (or chunks)
    whose units are interleaved on one compute stream so that one pass computes
    while another's TP all-reduce is in flight ("Synergistic Tensor and
    Pipeline Parallelism", arXiv 2510.27257, Fig. 3).

    Allowed pairings, those the STP schedule uses: F with B (W deferred), F
    with BW, F with one or more deferred W, F with F (the warm-up FF0 pairs).
    The first pass is always the forward.
    """

    passes: tuple[Pass, ...]

    def __post_init__(self) -> None:
        if len(self.passes) < 2:
            raise ValueError(f"a braided block needs at least two passes, got {len(self.passes)}")
        first, rest = self.passes[0], self.passes[1:]
        if first.kind is not Kind.F:
            raise ValueError(f"a braided block starts with a forward pass, got {first}")
        kinds = {p.kind for p in rest}
        ok = (
            (len(rest) == 1 and rest[0].kind in (Kind.F, Kind.B, Kind.BW))
            or kinds == {Kind.W}
        )
        if not ok:
            raise ValueError(
                f"unsupported braided block {self}: accepted are F with F, F with B, "
                "F with BW, or F with one or more W"
            )

    def __str__(self) -> str:
        return "(" + ";".join(str(p) for p in self.passes) + ")OVERLAP_F_B"


Action = Pass | Block


def passes_of(action: Action) -> tuple[Pass, ...]:
    """The passes an action runs, in order."""
    return action.passes if isinstance(action, Block) else (action,)


def format_action(action: Action) -> str:
    return str(action)


def looped_placement(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """Megatron's interleaved placement: rank r holds stages r, r+p, r+2p, ..."""
    return tuple(s % num_ranks for s in range(num_ranks * chunks))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """V placement (ZB-V, V-Half, V-Min, STP): rank r holds stages r and 2p-1-r,
    so the V tip (stages p-1 -> p) stays on rank p-1 and the loss on rank 0."""
    p = num_ranks
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: placement plus one ordered action list per rank.

    `stage_to_rank[s]` is the rank holding global stage s. The number of chunks
    per rank `v` is `num_stages // num_ranks`; a rank's chunk index of a stage
    is the stage's position among that rank's stages in increasing order
    (V placement: chunk 0 is stage r, chunk 1 is stage 2p-1-r).
    """

    name: str
    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    meta: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"schedule has {len(self.actions)} action lists for {self.num_ranks} ranks"
            )
        if not self.stage_to_rank:
            raise ValueError("placement is empty")
        for s, r in enumerate(self.stage_to_rank):
            if not 0 <= r < self.num_ranks:
                raise ValueError(f"stage {s} placed on rank {r}, outside 0..{self.num_ranks - 1}")
        counts = [0] * self.num_ranks
        for r in self.stage_to_rank:
            counts[r] += 1
        if len(set(counts)) != 1:
            raise ValueError(f"placement gives ranks unequal stage counts {counts}")

    # -- derived facts -------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def chunks(self) -> int:
        """v: model chunks (stages) per rank."""
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def chunk_of(self, stage: int) -> int:
        return self.stages_of(self.stage_to_rank[stage]).index(stage)

    def passes(self, rank: int) -> Iterator[Pass]:
        for a in self.actions[rank]:
            yield from passes_of(a)

    @property
    def split_backward(self) -> bool:
        """True when the schedule uses B/W instead of full backwards."""
        return any(p.kind is Kind.W for r in range(self.num_ranks) for p in self.passes(r))

    # -- text form -------------------------------------------------------------

    def rows(self) -> list[list[str]]:
        """One list of action strings per rank (PyTorch's compute-only CSV rows)."""
        return [[str(a) for a in acts] for acts in self.actions]

    def format(self) -> str:
        """Readable multi-line form: `rank r: 0F0 0F1 ...`."""
        return "\n".join(f"rank {r}: " + " ".join(row) for r, row in enumerate(self.rows()))


# -- what every generator ends with --------------------------------------------


def drop_microbatches(actions: Sequence[Action], m: int) -> tuple[Action, ...]:
    """`actions` with every pass of microbatch >= m removed; a block left with one
    pass becomes that pass. A generator whose rule needs more microbatches builds
    its order for enough of them and drops the rest: the order stays valid (only
    passes go), the rule's bubble and peak may not hold."""
    out: list[Action] = []
    for a in actions:
        kept = tuple(q for q in passes_of(a) if q.mb < m)
        if len(kept) == 1:
            out.append(kept[0])
        elif kept:
            out.append(Block(kept))
    return tuple(out)


def looped_schedule(name: str, num_microbatches: int, chunks: int,
                    actions: Sequence[Sequence[Action]], **meta: object) -> Schedule:
    """A schedule on the looped placement (rank r holds r, r+p, ..., r+(v-1)p), one
    action list per rank; `meta` records `chunks` first, then the generator's facts."""
    p = len(actions)
    return Schedule(name=name, num_ranks=p, num_microbatches=num_microbatches,
                    stage_to_rank=looped_placement(p, chunks),
                    actions=tuple(tuple(row) for row in actions),
                    meta={"chunks": chunks, **meta})


def v_schedule(name: str, num_microbatches: int, actions: Sequence[Sequence[Action]],
               **meta: object) -> Schedule:
    """A schedule on the V placement (rank r holds stages r and 2p-1-r), one action
    list per rank; `meta` records `chunks` (2) first, then the generator's facts."""
    p = len(actions)
    return Schedule(name=name, num_ranks=p, num_microbatches=num_microbatches,
                    stage_to_rank=v_placement(p), actions=tuple(tuple(row) for row in actions),
                    meta={"chunks": 2, **meta})
