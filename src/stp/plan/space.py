"""The configurations `stp plan` considers: meshes, microbatching, schedules, levers.

A configuration is a mesh (GPUs = pp x tp x dp), a microbatch size b and
count m (global batch = dp x m x b), a schedule, and the memory levers a run
may turn on (the sharded optimizer, sequence parallelism, selective or full
recomputation, activation offload). A mesh is kept when

* tp divides the node (`--gpus-per-node`: TP stays on the fast link), the
  model's heads, and divides or is a multiple of its key/value heads (each
  TP rank holds whole heads, `stp.costmodel.decoder.spec.ModelSpec`);
* dp divides the global batch (every replica gets whole sequences);
* some schedule's stages fit in the model's layers (one layer per stage at
  least);
* for a mixture of experts, each (pp, tp, dp) once per expert-parallel size
  ep that divides dp and the experts (`ep_options`; ep 1
  included): the EP group is carved from the DP ranks, as stp's runtime
  carves it.

A schedule that takes chunks (v stages per rank on the looped placement:
1f1b-interleaved, zb-interleaved, looped-bfs) is tried at every v from 2 to
`MAX_CHUNKS` whose pp x v stages the layers fill: interleaving shrinks the
bubble to (p-1)/(v m) of the compute (Narayanan et al., arXiv 2104.04473,
section 2.2.2) and costs v times the point-to-point sends and more
activations in flight, which the simulator prices.

Levers are a ladder, cheapest first in step time (`LEVERS`): a run turns on
the next one only when the previous does not fit the budget. The sharded
optimizer and sequence parallelism cost no time in the cost model (a
reduce-scatter and an all-gather move what the all-reduce they replace
moved: Korthikanti et al., arXiv 2205.05198, section 4.2.2; ZeRO stage 1,
arXiv 1910.02054, section 5.1); recomputation adds forward work to B;
offload adds host copies that may not hide.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.memory import Features
from stp.plan.request import PlanRequest
from stp.schedule.registry import SCHEDULES, generate

__all__ = ["Mesh", "Config", "LEVERS", "BRAIDED", "meshes", "microbatchings", "schedules_for",
           "ep_options", "levers_for", "stages_of", "MAX_STAGE_MICROBATCHES", "MAX_CHUNKS",
           "chunk_options", "every_config"]

BRAIDED = ("stp", "dualpipev")
"""Schedules whose blocks braid passes to hide TP collectives and a mixture of
experts' all-to-alls: considered only where TP > 1 or EP > 1 (otherwise
there is nothing to hide)."""

MAX_CHUNKS = 8
"""Most stages per rank tried for a schedule that takes chunks: past 8 the
bubble term (p-1)/(v m) gains little while sends grow with v."""

MAX_STAGE_MICROBATCHES = 16384
"""Stages x microbatches simulated at most per configuration (a 2-core machine
simulates that in about a second); a microbatching past it is skipped in
favour of larger microbatches."""

LEVERS: tuple[tuple[str, dict[str, object]], ...] = (
    ("none", {}),
    ("shard-optimizer", {"shard_optimizer": True}),
    ("sequence-parallel", {"shard_optimizer": True, "sequence_parallel": True}),
    ("selective", {"shard_optimizer": True, "sequence_parallel": True,
                   "recompute": "selective"}),
    ("offload", {"shard_optimizer": True, "sequence_parallel": True,
                 "recompute": "selective", "offload": "all"}),
    ("full", {"shard_optimizer": True, "sequence_parallel": True, "recompute": "full"}),
    ("full+offload", {"shard_optimizer": True, "sequence_parallel": True, "recompute": "full",
                      "offload": "all"}),
)
"""The memory levers in the order a plan turns them on (module doc)."""


@dataclass(frozen=True, order=True)
class Mesh:
    pp: int
    tp: int
    dp: int
    ep: int = 1
    """Expert-parallel ranks of a mixture of experts, carved from the dp ranks
    (ep divides dp); 1 for a dense model."""


@dataclass(frozen=True)
class Config:
    """One configuration to price: a mesh, a microbatching, a schedule, levers."""

    mesh: Mesh
    microbatch_size: int
    microbatches: int
    schedule: str
    features: Features
    chunks: int | None = None
    """Stages per rank for a schedule that takes chunks; None: its default
    (two) or a schedule that takes none."""

    def options(self) -> dict[str, int]:
        """Keyword options of the schedule generator."""
        return {} if self.chunks is None else {"chunks": self.chunks}


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def ep_options(request: PlanRequest, dp: int) -> list[int]:
    """The expert-parallel sizes a mesh with `dp` replicas may take: [1] for a dense
    model; for a mixture of experts every divisor of dp that divides its experts
    (only those of `request.ep` when given)."""
    model = request.model
    if not model.has_experts:
        return [1]
    sizes = model.ep_sizes()
    return [ep for ep in _divisors(dp) if ep in sizes
            and (request.ep is None or ep in request.ep)]


def _tp_fits(model: ModelSpec, tp: int) -> bool:
    return model.heads % tp == 0 and (model.kv_heads % tp == 0 or tp % model.kv_heads == 0)


@lru_cache(maxsize=4096)
def stages_of(schedule: str, pp: int, chunks: int | None = None) -> int:
    """Global stages of `schedule` at `pp` ranks (0: it does not take pp)."""
    if pp < SCHEDULES[schedule].min_ranks:
        return 0
    return generate(schedule, pp, 1, **({} if chunks is None else {"chunks": chunks})).num_stages


def chunk_options(schedule: str, pp: int, layers: int) -> list[int | None]:
    """The chunks tried for `schedule` at `pp` ranks (module doc): [None] for a
    schedule that takes none (or pp 1, where chunks only add stages), else
    every v from 2 to MAX_CHUNKS with a layer for each of the pp x v stages."""
    if not SCHEDULES[schedule].takes_chunks or pp == 1:
        return [None]
    return [v for v in range(2, MAX_CHUNKS + 1) if pp * v <= layers] or [None]


def schedules_for(request: PlanRequest, mesh: Mesh) -> list[tuple[str, int | None]]:
    """The (schedule, chunks) a mesh may run: registered (or asked for),
    taking its pp, whose stages the model's layers fill; braided ones only
    with TP or EP; a schedule that takes chunks at each v of `chunk_options`."""
    names = request.schedules or tuple(SCHEDULES)
    out = []
    for name in names:
        if name in BRAIDED and mesh.tp == mesh.ep == 1 and request.schedules is None:
            continue
        for v in chunk_options(name, mesh.pp, request.model.layers):
            stages = stages_of(name, mesh.pp, v)
            if 0 < stages <= request.model.layers:
                out.append((name, v))
    return out


def meshes(request: PlanRequest) -> Iterator[Mesh]:
    """Every pp x tp x dp = gpus the model and the batch admit (module doc)."""
    model = request.model
    for tp in _divisors(request.gpus):
        if request.gpus_per_node % tp or not _tp_fits(model, tp):
            continue
        for pp in _divisors(request.gpus // tp):
            dp = request.gpus // (tp * pp)
            if request.global_batch % dp or pp > model.layers:
                continue
            for ep in ep_options(request, dp):
                mesh = Mesh(pp, tp, dp, ep)
                if schedules_for(request, mesh):
                    yield mesh


def microbatchings(request: PlanRequest, mesh: Mesh) -> list[tuple[int, int]]:
    """(microbatch size b, microbatches m) with dp x m x b = the global batch,
    b up to `max_microbatch_size`, stages x m within MAX_STAGE_MICROBATCHES."""
    per_replica = request.global_batch // mesh.dp
    out = []
    for b in _divisors(per_replica):
        m = per_replica // b
        if b <= request.max_microbatch_size and 2 * mesh.pp * m <= MAX_STAGE_MICROBATCHES:
            out.append((b, m))
    return out


def levers_for(request: PlanRequest, mesh: Mesh) -> list[tuple[str, Features]]:
    """The ladder of `LEVERS` that changes something on this mesh: the sharded
    optimizer only with dp > 1, sequence parallelism only with tp > 1 (and a
    sequence that divides by tp)."""
    out: list[tuple[str, Features]] = []
    seen: set[Features] = set()
    for name, raw in LEVERS:
        kw = dict(raw)
        if mesh.dp == 1:
            kw.pop("shard_optimizer", None)
        if mesh.tp == 1 or request.seq_len % mesh.tp or not request.allow_sequence_parallel:
            kw.pop("sequence_parallel", None)
        if not request.allow_offload and "offload" in kw:
            continue
        feats = Features(dtype=request.dtype, **kw)  # type: ignore[arg-type]  # the levers' values each have their field's type
        if feats not in seen:
            seen.add(feats)
            out.append((name, feats))
    return out


def every_config(request: PlanRequest) -> Iterator[Config]:
    """Every configuration of the space, before any pruning (the planner walks the
    same loops, trying a mesh's lever ladder rung by rung instead of all of it)."""
    for mesh in meshes(request):
        for b, m in microbatchings(request, mesh):
            for name, chunks in schedules_for(request, mesh):
                for _, features in levers_for(request, mesh):
                    yield Config(mesh, b, m, name, features, chunks)
