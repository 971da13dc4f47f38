"""The pp x tp x dp device mesh: validated sizes, rank layout, process groups.

Rank layout (row-major over the named axes pp, dp, tp; tp fastest):

    global rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ranks of one TP group are consecutive (one node, the fastest links:
TP all-reduces run twice per layer per pass, Megatron-LM's placement), the
DP replicas of a stage come next and pipeline stages are farthest apart
(point-to-point only).

Expert parallelism (`ep`, a mixture of experts' all-to-all) is carved from
the DP ranks, as Megatron-LM arranges it: the world stays pp x tp x dp, ep
divides dp, and ep consecutive DP ranks of one (pp, tp) position form an
expert-parallel (EP) group, each holding E / ep experts. The DP ranks at
the same place in every EP group hold the same experts: their
expert-data-parallel (EDP) group, of dp / ep ranks, over which expert
gradients are reduced:

    dp rank      0  1  2  3        (dp 4, ep 2)
    EP group    [0  1][2  3]       ep rank  = dp % ep
    EDP group    0  .  2  .        edp rank = dp // ep
                 .  1  .  3 Everything is an object passed in; no module globals,
so several meshes can live in one test process (topology explicit and
injected, as torchtitan's ParallelDims).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["ParallelDims", "Coord", "Mesh"]


class Coord(NamedTuple):
    """A rank's position on the mesh."""

    pp: int
    tp: int
    dp: int


def _check_size(axis: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mesh size {axis}={value!r} not accepted; it must be an integer >= 1")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes: pp x tp x dp ranks, and ep carved from dp."""

    pp: int = 1
    """Pipeline ranks (each holds one or more stages, per the schedule's placement)."""
    tp: int = 1
    """Tensor-parallel ranks per stage (heads, FFN and vocabulary are split)."""
    dp: int = 1
    """Data-parallel replicas (gradients averaged)."""
    ep: int = 1
    """Expert-parallel ranks, carved from the DP ranks (module doc); must divide dp."""

    def __post_init__(self) -> None:
        for axis in ("pp", "tp", "dp", "ep"):
            _check_size(axis, getattr(self, axis))
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (the expert-parallel "
                             "groups are carved from the data-parallel ranks)")

    @property
    def edp(self) -> int:
        """Ranks of an expert-data-parallel group (the replicas of one expert)."""
        return self.dp // self.ep

    def ep_groups(self) -> list[list[int]]:
        """Every EP group (ep consecutive DP ranks of one pp, tp position), fixed order."""
        return [dp_ranks[i : i + self.ep] for dp_ranks in self.all_groups("dp")
                for i in range(0, self.dp, self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """Every EDP group (the DP ranks at one place of every EP group), fixed order."""
        return [dp_ranks[j :: self.ep] for dp_ranks in self.all_groups("dp")
                for j in range(self.ep)]

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def check_world(self, world_size: int) -> None:
        """ValueError unless the world has exactly pp x tp x dp ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} does not match pp x tp x dp = {self.pp} x {self.tp} x "
                f"{self.dp} = {self.world_size}; start {self.world_size} processes or change "
                "--pp/--tp/--dp"
            )

    def rank_of(self, coord: Coord) -> int:
        return (coord.pp * self.dp + coord.dp) * self.tp + coord.tp

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coord(pp, tp, dp)

    def group_ranks(self, axis: str, coord: Coord) -> list[int]:
        """Global ranks along `axis` through `coord`, ordered by that axis."""
        if axis not in ("pp", "tp", "dp"):
            raise ValueError(f"unknown mesh axis {axis!r}; accepted: pp, tp, dp")
        size = getattr(self, axis)
        return [self.rank_of(coord._replace(**{axis: i})) for i in range(size)]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, in a fixed order (all ranks must create them alike)."""
        others = [a for a in ("pp", "tp", "dp") if a != axis]
        groups = []
        for i in range(getattr(self, others[0])):
            for j in range(getattr(self, others[1])):
                base = Coord(0, 0, 0)._replace(**{others[0]: i, others[1]: j})
                groups.append(self.group_ranks(axis, base))
        return groups


@dataclass
class Mesh:
    """This rank's place on the mesh and its three process groups.

    Build with `Mesh.from_world(dims)` after `torch.distributed` is
    initialised. Group ranks equal the axis coordinate (pipeline peer `r` is
    group rank `r` of `pp_group`).
    """

    dims: ParallelDims
    rank: int
    coord: Coord
    pp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    backend: str
    device: torch.device
    ranks: dict[str, list[int]] = field(default_factory=dict)
    ep_group: dist.ProcessGroup | None = None
    """This rank's expert-parallel group (None at ep 1)."""
    edp_group: dist.ProcessGroup | None = None
    """This rank's expert-data-parallel group (None at ep 1)."""

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group (which experts it holds)."""
        return self.coord.dp % self.dims.ep

    @property
    def edp_rank(self) -> int:
        """This rank's place among the replicas of its experts."""
        return self.coord.dp // self.dims.ep

    def first_replica(self, expert: bool = False) -> bool:
        """Is this rank the first DP replica of a parameter (the one that writes it
        when the whole model is written)? An expert's replicas are its EDP group."""
        return self.edp_rank == 0 if expert else self.coord.dp == 0

    @classmethod
    def from_world(
        cls,
        dims: ParallelDims,
        *,
        device: torch.device | str | None = None,
        timeout: float | None = None,
    ) -> Mesh:
        """Validate the world against `dims` and create the pp, tp, dp groups.

        Collective: every rank of the world must call it with the same dims.
        `timeout` (seconds) bounds every collective on the new groups.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised; call init_process_group first")
        dims.check_world(dist.get_world_size())
        rank = dist.get_rank()
        coord = dims.coord_of(rank)
        backend = str(dist.get_backend())
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
        mine: dict[str, dist.ProcessGroup] = {}
        ranks: dict[str, list[int]] = {}
        for axis in ("pp", "tp", "dp"):
            for group_ranks in dims.all_groups(axis):
                group = dist.new_group(group_ranks, **kw)
                if rank in group_ranks:
                    mine[axis], ranks[axis] = group, group_ranks
        if dims.ep > 1:
            for axis, groups in (("ep", dims.ep_groups()), ("edp", dims.edp_groups())):
                for group_ranks in groups:
                    group = dist.new_group(group_ranks, **kw)
                    if rank in group_ranks:
                        mine[axis], ranks[axis] = group, group_ranks
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else (
                torch.device("cpu")
            )
        return cls(
            dims, rank, coord, mine["pp"], mine["tp"], mine["dp"], backend,
            torch.device(device), ranks, mine.get("ep"), mine.get("edp"),
        )

    def describe(self) -> str:
        """`rank 3 (pp 1, tp 1, dp 0)`: used in every runtime message."""
        c = self.coord
        return f"rank {self.rank} (pp {c.pp}, tp {c.tp}, dp {c.dp})"

    def describe_group(self, axis: str) -> str:
        """This rank's group along `axis` as error messages name it."""
        names = {"pp": "pipeline", "tp": "TP", "dp": "DP", "ep": "expert-parallel",
                 "edp": "expert-data-parallel"}
        return f"the {names[axis]} group (global ranks {self.ranks[axis]})"

    def pp_peer_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank `pp_rank` in this rank's pipeline."""
        return self.ranks["pp"][pp_rank]
