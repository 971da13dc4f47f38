"""Emulated compute: units that wait instead of computing, with real communication.

On a CPU machine compute and gloo compete for the same cores, so a measured
overlap mixes two effects. An `EmulatedStage` has the decoder's unit
structure (two units per layer, attention and MLP, each F and B unit ending
in a TP all-reduce of a real [b, s, h] tensor; STP paper arXiv 2510.27257, Fig. 2), but each
unit's compute is a timed wait: F units take `f`, B units `b`, W units `w`
seconds. Sends, receives and all-reduces stay real, with the real sizes, so
the runtime's schedule, braiding and overlap are measured on any laptop.

Durations come as the simulator's costs (stp.sim.costs.Costs: one
microbatch through one rank's whole share), `f=24,b=24,w=16` in
milliseconds, and are cut as the simulator cuts them: a unit of a stage of
`layers` layers on a rank of v chunks takes f / v / (2 layers). So
`stp train --emulate-compute f=24,b=24,w=16` and
`stp simulate --cost f=24,b=24,w=16,ar=..` describe the same run.

The wait sleeps until shortly before its deadline and spins the rest: a
plain sleep overshoots by about 0.1 ms on a VM, 5% of a 2 ms unit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.models.placement import StagePlacement, placed_builder
from stp.models.tp.comm import launch_sum
from stp.sim.costs import Costs

__all__ = ["UnitTimes", "parse_times", "parse_emulate", "unit_times", "hold", "EmulatedUnit",
           "EmulatedStage", "emulated_builder"]

_SPIN = 3e-4  # sleep until this close to the deadline, then spin


def hold(seconds: float) -> None:
    """Wait `seconds` (emulated compute): sleep, then spin the last ~0.3 ms."""
    deadline = time.perf_counter() + seconds
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        if left > _SPIN:
            time.sleep(left - _SPIN)


@dataclass(frozen=True)
class UnitTimes:
    """Seconds one F, B and W unit takes."""

    f: float
    b: float
    w: float


def parse_times(text: str, what: str = "--emulate-compute") -> tuple[float, float, float]:
    """`f=24,b=24,w=16` -> (f, b, w) as given (missing keys: 0). ValueError naming
    the bad item and what is accepted: keys f, b, w, numbers >= 0, one > 0."""
    vals = {"f": 0.0, "b": 0.0, "w": 0.0}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, val = (x.strip() for x in item.partition("="))
        if not sep or key not in vals:
            raise ValueError(f"{what} item {item!r} not accepted: give f=.., b=.., w=.. "
                             "(compute only; all-reduces and sends are real)")
        try:
            num = float(val)
        except ValueError:
            raise ValueError(f"{what} {key}={val!r} is not a number") from None
        if not 0 <= num < float("inf"):
            raise ValueError(f"{what} {key}={val} must be a finite number >= 0")
        vals[key] = num
    if not any(vals.values()):
        raise ValueError(f"{what} {text!r}: at least one of f, b, w must be > 0")
    return vals["f"], vals["b"], vals["w"]


def parse_emulate(text: str) -> Costs:
    """`f=24,b=24,w=16` (milliseconds per microbatch per rank share, as
    `stp simulate --cost`) -> Costs in seconds."""
    f, b, w = parse_times(text)
    return Costs(f=f / 1e3, b=b / 1e3, w=w / 1e3)


def unit_times(costs: Costs, chunks: int, layers: int) -> UnitTimes:
    """Per-unit seconds, as the simulator cuts a pass: cost / v / (2 layers)."""
    n = chunks * 2 * layers
    return UnitTimes(costs.f / n, costs.b / n, costs.w / n)


class EmulatedUnit:
    """One unit (attention or MLP of a layer) that waits instead of computing.

    Its partial sums are fresh-looking [b, s, h] tensors taken from a small
    ring of buffers (the values do not matter; the sizes do)."""

    def __init__(self, name: str, stage: EmulatedStage, index: int) -> None:
        self.name = name
        self.owner = stage
        self.index = index

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.index == 0:
            self.owner.shapes[mb] = (*x.shape[:2], self.owner.hidden)
        hold(self.owner.times.f)
        return self.owner.buffer(mb)

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        if self.owner.is_last and self.index == len(self.owner.units) - 1:
            return torch.zeros((), dtype=torch.float64)  # the loss is not computed
        return reduced

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor:
        hold(self.owner.times.b)
        return self.owner.buffer(mb)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        if self.index == 0:
            self.owner.shapes.pop(mb, None)
            if self.owner.is_first:
                return None  # token ids have no gradient
        return reduced

    def weight(self, mb: int) -> None:
        hold(self.owner.times.w)


class EmulatedStage(nn.Module):
    """Stage `stage` of `num_stages` with `layers` emulated layers; a PipelineStage
    whose `units` stp.runtime.braid drives. Holds one placeholder parameter so a
    Trainer can run its optimizer and checkpoint as usual (nothing is trained)."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        *,
        layers: int,
        hidden: int,
        times: UnitTimes,
        tp_group: dist.ProcessGroup | None = None,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.hidden, self.times = hidden, times
        self.tp_group, self.tp_size = tp_group, tp_size
        self.dtype, self.device = dtype, torch.device(device)
        self.units = tuple(
            EmulatedUnit(f"layers.{i // 2}.{('attn', 'mlp')[i % 2]}", self, i)
            for i in range(2 * layers)
        )
        self.register_parameter(f"placeholder{stage}", nn.Parameter(torch.zeros(1, dtype=dtype)))
        self.shapes: dict[int, tuple[int, ...]] = {}
        self._ring: list[torch.Tensor] = []
        self._next = 0

    def buffer(self, mb: int) -> torch.Tensor:
        """A [b, s, h] tensor from a ring of 8 (allocated once per shape)."""
        shape = self.shapes[mb]
        if not self._ring or tuple(self._ring[0].shape) != shape:
            self._ring = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(8)]
        self._next = (self._next + 1) % len(self._ring)
        return self._ring[self._next]

    def shard_dim(self, name: str) -> None:
        return None

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        want = 2 if self.is_first else 3
        if x.dim() != want:
            raise ValueError(f"emulated stage {self.stage} takes a {want}-dim input, got "
                             f"{tuple(x.shape)}")

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the real TP all-reduce of a partial sum (see ModelStage)."""
        if self.tp_size == 1:
            return partial, None
        return partial, launch_sum(partial, self.tp_group)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        tensor, work = self.launch_allreduce(partial)
        if work is not None:
            work.wait()
        return tensor

    # -- PipelineStage (pass at a time, every all-reduce waited for) -------------

    def forward(self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        self.check_input(x, targets)
        for u in self.units:
            x = u.forward_finish(mb, self._reduce(u.forward_partial(mb, x, targets)))
        return x

    def backward_input(self, mb: int, grad: torch.Tensor | None, scale: float = 1.0) -> Any:
        g: Any = grad
        for u in reversed(self.units):
            g = u.backward_finish(mb, self._reduce(u.backward_partial(mb, g)))
        return g

    def backward_weight(self, mb: int) -> None:
        for u in reversed(self.units):
            u.weight(mb)

    def backward_full(self, mb: int, grad: torch.Tensor | None, scale: float = 1.0) -> Any:
        g = self.backward_input(mb, grad, scale)
        self.backward_weight(mb)
        return g


def emulated_builder(costs: Costs, chunks: int, num_layers: int, hidden: int) -> Any:
    """A Trainer stage builder (stp.train.step.trainer.StageBuilder) of emulated stages: the
    model's `num_layers` split over the stages as stp.models splits them
    (stp.models.placement.StagePlacement.layers), each stage's units timed so that one
    pass through it takes cost / chunks (`costs` in seconds, per microbatch per rank
    share, as the simulator's)."""
    def build(_config: None, p: StagePlacement) -> EmulatedStage:
        layers = len(p.layers(num_layers))
        return EmulatedStage(p.stage, p.num_stages, layers=layers, hidden=hidden,
                             times=unit_times(costs, chunks, layers), tp_group=p.tp_group,
                             tp_size=p.tp_size, dtype=p.dtype, device=p.device)

    return placed_builder(build, None)
