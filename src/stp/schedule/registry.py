"""One registry of schedule generators, looked up by name.

A generator is a pure function `(num_ranks, num_microbatches, **options) ->
Schedule`. Every generator accepts any microbatch count m >= 1 (the V and STP
generators build small m by truncating a larger schedule), so an entry states
only the smallest pipeline size it accepts; bad input is refused with a
message naming what is accepted, before any work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from stp.schedule.ir import Schedule
from stp.schedule.validate import validate

__all__ = ["GeneratorSpec", "SCHEDULES", "get", "generate", "make", "names"]


@dataclass(frozen=True)
class GeneratorSpec:
    name: str
    summary: str
    module: str
    func: str
    min_ranks: int = 1
    takes_chunks: bool = False
    """Accepts `chunks` (stages per rank on the looped placement; `--chunks`)."""

    def load(self) -> Callable[..., Schedule]:
        return getattr(import_module(self.module), self.func)


_G = "stp.schedule.gen_"

SCHEDULES: dict[str, GeneratorSpec] = {
    s.name: s
    for s in [
        GeneratorSpec(
            "gpipe", "GPipe: all forwards, then all full backwards",
            _G + "classic", "gpipe",
        ),
        GeneratorSpec(
            "1f1b", "1F1B: warm-up forwards, then one forward one full backward",
            _G + "classic", "one_f_one_b",
        ),
        GeneratorSpec(
            "1f1b-interleaved", "Interleaved 1F1B (Megatron), v chunks per rank, looped placement",
            _G + "classic", "interleaved_1f1b", takes_chunks=True,
        ),
        GeneratorSpec(
            "zb-h1", "Zero Bubble H1: split backward, 1F1B memory, bubble (p-1)(F+B-W)",
            _G + "zb", "zb_h1",
        ),
        GeneratorSpec(
            "zb-h2", "Zero Bubble H2: split backward, 2p-1 memory, bubble (p-1)(F+B-2W)",
            _G + "zb", "zb_h2",
        ),
        GeneratorSpec(
            "zb-v", "Zero Bubble V: V placement, zero bubble when F=B=W, 1F1B memory",
            _G + "v", "zb_v",
        ),
        GeneratorSpec(
            "v-half", "V-Half (controllable memory): half of 1F1B's activation memory",
            _G + "v", "v_half",
        ),
        GeneratorSpec(
            "v-min", "V-Min (controllable memory): a third of 1F1B's activation memory",
            _G + "v", "v_min",
        ),
        GeneratorSpec(
            "stp", "STP: V placement with braided F/B blocks hiding TP all-reduce",
            _G + "stp", "stp",
        ),
        GeneratorSpec(
            "looped-bfs",
            "LoopedBFS: breadth first, every microbatch through a chunk, then the next",
            _G + "bfs", "looped_bfs", takes_chunks=True,
        ),
        GeneratorSpec(
            "zb-interleaved",
            "Interleaved Zero Bubble: interleaved 1F1B with split backward (ZB1P)",
            _G + "zb_interleaved", "zb_interleaved", takes_chunks=True,
        ),
        GeneratorSpec(
            "dualpipev", "DualPipeV: V placement, F&B pairs braided to hide TP all-reduce",
            _G + "dualpipe", "dualpipev",
        ),
    ]
}


def names() -> list[str]:
    return list(SCHEDULES)


def get(name: str) -> GeneratorSpec:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}"
        ) from None


def generate(name: str, num_ranks: int, num_microbatches: int, **options: object) -> Schedule:
    """Generate schedule `name` for `num_ranks` ranks and `num_microbatches`
    microbatches. Raises ValueError naming the bad value and what is accepted."""
    spec = get(name)
    if not isinstance(num_ranks, int) or num_ranks < spec.min_ranks:
        raise ValueError(
            f"{name}: pipeline size {num_ranks!r} not accepted; it needs pp >= {spec.min_ranks}"
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"{name}: {num_microbatches!r} microbatches not accepted at pp={num_ranks}; "
            "it needs at least 1"
        )
    return spec.load()(num_ranks, num_microbatches, **options)


def make(name: str, num_ranks: int, num_microbatches: int | None = None) -> Schedule:
    """Generate and validate schedule `name` for `num_ranks` ranks.

    `num_microbatches` defaults to 2 * num_ranks: past ZB-V's 2p-1, the
    smallest m at which its full rule runs, and every 1F1B-style schedule has
    a steady phase, while a default step stays short (STP's nine phases need
    3p-1; below that it runs truncated, still valid). Raises ValueError (a
    `ScheduleError` for an invalid result) naming the bad value.
    """
    m = 2 * num_ranks if num_microbatches is None else num_microbatches
    schedule = generate(name, num_ranks, m)
    validate(schedule)
    return schedule
