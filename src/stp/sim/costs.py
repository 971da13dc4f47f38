"""Cost inputs of the simulator, parsed from `--cost f=..,b=..` strings.

All times are for one microbatch through one rank's whole share of the model
(all of its chunks); a schedule with v chunks per rank runs each chunk pass in
1/v of them. So `f=2` with v=2 means T_F = 1 per chunk, as in the STP table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from stp.schedule.memory import MemCosts

__all__ = ["Costs", "MemCosts", "OffloadCosts", "parse_costs", "parse_kv", "parse_mem"]


@dataclass(frozen=True)
class Costs:
    """Times of one microbatch through one rank's share (any time unit)."""

    f: float = 1.0
    """Forward compute."""
    b: float = 1.0
    """Input-gradient backward compute (Zero Bubble's B)."""
    w: float = 1.0
    """Weight-gradient backward compute (Zero Bubble's W)."""
    ar: float = 0.0
    """TP all-reduce time of one F (or one B) pass, all units together."""
    comm: float = 0.0
    """Point-to-point latency of one activation/gradient send between ranks."""
    ag: float = 0.0
    """Sequence parallelism: all-gather time of one F (or one B) pass, all units
    together; each F/B unit starts with one (before its column-parallel linears)."""
    rs: float = 0.0
    """Sequence parallelism: reduce-scatter time of one F (or one B) pass, all units
    together; each F/B unit ends with one (after its row-parallel linears)."""
    a2a: float = 0.0
    """Expert parallelism: all-to-all time of one F (or one B) pass, all units
    together. An MoE layer runs two in F (dispatch the tokens to their experts'
    ranks, combine the results back) and their two duals in B; each F/B unit
    ends with one, after its TP collective (`stp.sim.engine`)."""

    def __post_init__(self) -> None:
        for fl in fields(self):
            val = getattr(self, fl.name)
            if not isinstance(val, int | float) or val != val or val < 0 or val == float("inf"):
                raise ValueError(f"cost {fl.name}={val!r} must be a finite number >= 0")
        if self.f + self.b + self.w <= 0:
            raise ValueError("costs f, b, w are all zero; at least one must be > 0")

    @property
    def tp_time(self) -> float:
        """All collective time of one F (or B) pass that a braid can hide: the TP
        all-reduces, or with sequence parallelism the all-gathers and
        reduce-scatters (a ring all-reduce is exactly one reduce-scatter and one
        all-gather of the same bytes), and the expert all-to-alls."""
        return self.ar + self.ag + self.rs + self.a2a


@dataclass(frozen=True)
class OffloadCosts:
    """Host-link model for activation offload ("PipeOffload: Improving
    Scalability of Pipeline Parallelism with Memory Optimization", arXiv
    2503.01328).

    Copying `x` units of M_B one way takes `x * act_bytes / bandwidth` time
    units. Defaults: one M_B is 1 byte and the link moves 1 byte per time
    unit, so a copy of one M_B takes one time unit; give real bytes and
    bytes/s (with costs in seconds) to model a machine.
    """

    bandwidth: float = 1.0
    """Host link bytes per time unit, each direction (D2H and H2D run at once)."""
    act_bytes: float = 1.0
    """Bytes of one M_B (one microbatch's activations for one rank's share)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, int | float) and 0 < self.bandwidth < float("inf")):
            raise ValueError(f"offload bandwidth {self.bandwidth!r} must be a number > 0")
        if not (isinstance(self.act_bytes, int | float) and 0 <= self.act_bytes < float("inf")):
            raise ValueError(f"activation bytes {self.act_bytes!r} must be a number >= 0")

    def copy_time(self, units_of_mb: float) -> float:
        return units_of_mb * self.act_bytes / self.bandwidth


def parse_kv(text: str, allowed: tuple[str, ...], what: str) -> dict[str, float]:
    """`"a=1,b=2"` -> {"a": 1.0, "b": 2.0}, keys among `allowed` (one-line errors)."""
    out: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{what} item {item!r} is not KEY=VALUE (keys: {', '.join(allowed)})")
        if key not in allowed:
            raise ValueError(f"unknown {what} key {key!r}; accepted: {', '.join(allowed)}")
        try:
            num = float(val)
        except ValueError:
            raise ValueError(f"{what} {key}={val.strip()!r} is not a number") from None
        out[key] = num
    return out


def parse_costs(text: str | None, base: Costs | None = None) -> Costs:
    """`"f=1,b=1,w=1,ar=0.2,comm=0"` (or `ag=0.1,rs=0.1` for sequence
    parallelism; `a2a=0.3` for expert parallelism's all-to-alls) -> Costs;
    missing keys keep `base`'s values."""
    base = base or Costs()
    if not text:
        return base
    kv = parse_kv(text, tuple(f.name for f in fields(Costs)), "cost")
    vals = {f.name: getattr(base, f.name) for f in fields(Costs)}
    vals.update(kv)
    return Costs(**vals)


def parse_mem(text: str | None, base: MemCosts | None = None) -> MemCosts:
    """`"b=1,w=0.3"` -> MemCosts (M_B, M_W per microbatch per rank share)."""
    base = base or MemCosts()
    if not text:
        return base
    kv = parse_kv(text, ("b", "w"), "memory")
    return MemCosts(m_b=kv.get("b", base.m_b), m_w=kv.get("w", base.m_w))
