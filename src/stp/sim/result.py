"""What the simulator returns: timed spans on lanes, memory curves, summaries.

The pictures (`stp.viz`) and traces read these; the runtime's measured traces
use the same `Span` shape so measured and simulated runs line up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from stp.schedule.ir import Schedule
from stp.schedule.offload import OffloadPlan
from stp.sim.costs import Costs, MemCosts
from stp.sim.inlayer import InLayer
from stp.sim.stages import StageCosts

__all__ = ["Span", "RankStats", "SimResult", "LANES"]

LANES = ("compute", "tp", "send", "d2h", "h2d", "dp")
"""Lanes of a rank: compute stream, TP-communication stream, point-to-point
sends, (offload) device-to-host / host-to-device copies, and the DP gradient
reductions (measured traces: stp.runtime.trace)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One timed piece of work on one lane of one rank."""

    rank: int
    lane: str
    """One of LANES."""
    start: float
    end: float
    name: str
    """Action string of the pass it belongs to, e.g. '7F3'."""
    kind: str
    """F, B, W (compute lane); AR, or RS and AG under sequence parallelism, and A2A
    (expert parallelism's all-to-all) (tp lane);
    SEND (send lane); D2H/H2D (copies)."""
    stage: int
    mb: int
    chunk: int
    unit: int | None = None
    """Unit index within the pass (0..units-1, forward order); None for whole-pass spans."""
    action_index: int = -1
    """Position of the action in the rank's list; spans of one braided block share it."""
    braided: bool = False
    label: str | None = None
    """The unit's name in its stage (`layers.3.attn`, `layers.3.moe.route`), where the
    runtime knows it; None: the simulator's two units per layer (attention, MLP)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RankStats:
    rank: int
    start: float
    """Start of the rank's first forward."""
    end: float
    """End of the rank's last pass (including its outstanding all-reduces)."""
    compute: float
    """Busy time of the compute lane."""
    exposed_tp: float
    """Compute-lane time spent waiting on TP all-reduces."""
    peak_activation: float
    """Peak resident activations, units of M_B."""
    exposed_offload: float = 0.0
    """Compute-lane time spent waiting for a reload (activation offload)."""
    tp_total: float = 0.0
    """Time of every TP collective the rank runs (all-reduces, or with sequence
    parallelism all-gathers and reduce-scatters); what is not exposed is hidden."""
    exposed_a2a: float = 0.0
    """Compute-lane time spent waiting on expert-parallel all-to-alls."""
    a2a_total: float = 0.0
    """Time of every all-to-all the rank runs (two per MoE layer and pass)."""
    grads_final: dict[int, float] = field(default_factory=dict)
    """Stage (of this rank) -> when its last gradient pass (B, W or a full backward)
    ends: from then its DP gradient reduction may run (stp.sim.dp_overlap)."""

    @property
    def hidden_tp(self) -> float:
        """TP collective time that ran under compute (never below 0)."""
        return max(0.0, self.tp_total - self.exposed_tp)

    @property
    def hidden_a2a(self) -> float:
        """All-to-all time that ran under compute (never below 0)."""
        return max(0.0, self.a2a_total - self.exposed_a2a)

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def idle(self) -> float:
        """Pipeline bubble of this rank: span not spent computing, waiting on TP,
        on an all-to-all or on a reload."""
        return (self.span - self.compute - self.exposed_tp - self.exposed_a2a
                - self.exposed_offload)


@dataclass
class SimResult:
    schedule: Schedule
    costs: Costs
    mem: MemCosts
    layers: int
    makespan: float
    ranks: list[RankStats]
    spans: list[Span] = field(repr=False)
    memory: list[list[tuple[float, float]]] = field(repr=False)
    """Per rank: (time, resident activations) at every change, in time order."""
    offload: OffloadPlan | None = None
    stages: StageCosts | None = None
    """The per-stage cost table simulated (None: the uniform `costs`)."""
    mode: str = "braided"
    """How TP collectives were overlapped (`stp.sim.inlayer.MODES`)."""
    in_layer: InLayer | None = None
    """The chunking of passes that ran on their own (None: none chunked)."""

    @property
    def critical_rank(self) -> RankStats:
        """The rank with the longest span (the Zero Bubble paper's `cost`)."""
        return max(self.ranks, key=lambda r: (r.span, -r.rank))

    @property
    def bubble_rate(self) -> float:
        """(span - compute) / span on the longest-span rank (Zero Bubble, sec. 5)."""
        c = self.critical_rank
        return (c.span - c.compute) / c.span if c.span > 0 else 0.0

    @property
    def pp_bubble(self) -> float:
        c = self.critical_rank
        return c.idle

    @property
    def tp_bubble(self) -> float:
        return self.critical_rank.exposed_tp

    @property
    def a2a_bubble(self) -> float:
        """Exposed all-to-all time of the longest-span rank."""
        return self.critical_rank.exposed_a2a

    @property
    def peak_activation(self) -> list[float]:
        return [r.peak_activation for r in self.ranks]

    def to_json(self) -> dict[str, object]:
        """The `stp simulate --json` object."""
        return {
            "schedule": self.schedule.name,
            "pp": self.schedule.num_ranks,
            "microbatches": self.schedule.num_microbatches,
            "chunks": self.schedule.chunks,
            "layers": self.layers,
            "costs": asdict(self.costs),
            "mem": {"b": self.mem.m_b, "w": self.mem.m_w},
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "pp_bubble": self.pp_bubble,
            "tp_bubble": self.tp_bubble,
            "a2a_bubble": self.a2a_bubble,
            "peak_activation": self.peak_activation,
            "tp_overlap": self.mode,
            "tp_overlap_chunks": self.in_layer.chunks if self.in_layer else 0,
            "offload": self.offload.policy if self.offload else "none",
            "offloaded_passes": len(self.offload) if self.offload else 0,
            **self._stage_json(),
            "ranks": [
                {
                    "rank": r.rank,
                    "span": r.span,
                    "start": r.start,
                    "end": r.end,
                    "compute": r.compute,
                    "exposed_tp": r.exposed_tp,
                    "tp_total": r.tp_total,
                    "hidden_tp": r.hidden_tp,
                    "exposed_a2a": r.exposed_a2a,
                    "a2a_total": r.a2a_total,
                    "hidden_a2a": r.hidden_a2a,
                    "exposed_offload": r.exposed_offload,
                    "idle": r.idle,
                    "peak_activation": r.peak_activation,
                }
                for r in self.ranks
            ],
        }

    def _stage_json(self) -> dict[str, object]:
        """`partition` and `stage_costs` when the run had a per-stage table."""
        if self.stages is None:
            return {}
        table = self.stages.to_json()
        part = table.pop("partition", None)
        return {"partition": part, "stage_costs": table}
