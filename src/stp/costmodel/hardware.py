"""A GPU and its links, and the alpha-beta times of the transfers a step makes.

Times follow the usual latency-bandwidth (alpha-beta) model (Hockney 1994;
Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005):

    point-to-point   T = alpha + n / beta
    ring all-reduce  T = 2 (t-1) alpha + 2 (t-1)/t * n / beta
    ring all-gather  T = (t-1) alpha + (t-1)/t * n / beta     (n: the gathered bytes)
    ring reduce-scatter, the same                              (n: the bytes reduced)

Each rank of a ring moves (t-1)/t of the bytes once in an all-gather or a
reduce-scatter, and twice in an all-reduce, which is exactly a
reduce-scatter followed by an all-gather (Thakur et al., section 4.4):
sequence parallelism's two collectives cost what the all-reduce they
replace cost.

with `n` bytes, `t` ranks, `beta` the bandwidth of one direction of one link.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["HardwareSpec", "allgather_time", "allreduce_time", "p2p_time",
           "reduce_scatter_time"]


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and the links a TP x PP step uses. Units: FLOP/s, bytes/s, s."""

    peak_flops: float
    """Dense 16-bit matmul peak of one GPU (FLOP/s)."""
    efficiency: float = 0.5
    """Fraction of the peak a transformer layer's matmuls achieve (MFU of one pass)."""
    tp_bandwidth: float = 150e9
    """Bytes/s one direction between GPUs of a TP group (usually NVLink)."""
    tp_latency: float = 5e-6
    """Seconds per step of the TP ring."""
    pp_bandwidth: float = 25e9
    """Bytes/s one direction between neighbouring pipeline stages."""
    pp_latency: float = 10e-6
    """Seconds of one pipeline send."""
    host_bandwidth: float = 25e9
    """Bytes/s between GPU and host memory (PCIe), for activation offload."""
    name: str = "custom"
    memory: float = 0.0
    """Bytes of device memory one GPU offers (what nvidia-smi reports as total);
    0: not known (a custom spec that does not say)."""
    node_gpus: int = 8
    """GPUs of one node, linked at `tp_bandwidth` (NVLink); a collective whose group
    spans more runs its inter-node share at `pp_bandwidth` (expert parallelism's
    all-to-all, `stp.costmodel.moe`)."""

    def __post_init__(self) -> None:
        for fl in fields(self):
            if fl.name == "name":
                continue
            val = getattr(self, fl.name)
            if not isinstance(val, int | float) or isinstance(val, bool) or not val >= 0:
                raise ValueError(f"hardware {fl.name}={val!r} must be a number >= 0")
        for key in ("peak_flops", "tp_bandwidth", "pp_bandwidth", "host_bandwidth"):
            if getattr(self, key) <= 0:
                raise ValueError(f"hardware {key}={getattr(self, key)!r} must be > 0")
        if isinstance(self.node_gpus, float) or self.node_gpus < 1:
            raise ValueError(f"hardware node_gpus={self.node_gpus!r} must be an integer >= 1")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"hardware efficiency={self.efficiency!r} must be in (0, 1]")

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.efficiency


def allreduce_time(num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `num_bytes` over `ranks` GPUs (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency + steps / ranks * num_bytes / bandwidth


def allgather_time(num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather whose result is `num_bytes` (each rank brings 1/`ranks`)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * num_bytes / bandwidth


def reduce_scatter_time(num_bytes: float, ranks: int, bandwidth: float,
                        latency: float) -> float:
    """Ring reduce-scatter of `num_bytes` (each rank keeps 1/`ranks` of the sum)."""
    return allgather_time(num_bytes, ranks, bandwidth, latency)


def p2p_time(num_bytes: float, bandwidth: float, latency: float) -> float:
    """One point-to-point send of `num_bytes`."""
    return latency + num_bytes / bandwidth
