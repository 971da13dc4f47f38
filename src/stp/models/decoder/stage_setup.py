"""What the decoder's stage builders (and those built on it: the multimodal and
the MoE stages) run around a stage: the config checked against the TP split and
the stage count, with one clear ValueError, and the recomputation mode and the
in-layer TP overlap handed to every unit."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from stp.models.decoder.chunked import ChunkedRegion
from stp.models.decoder.units import Unit
from stp.models.recompute import check_recompute
from stp.shapes.decoder import ModelConfig

__all__ = ["check_model", "check_tp", "set_overlap", "set_recompute", "with_tp_overlap"]


def check_tp(config: ModelConfig, tp_size: int, tp_rank: int) -> None:
    """ValueError unless the heads and the MLP width split over tp_size ranks (the
    vocabulary is padded to a multiple of tp_size; fewer kv heads than ranks are
    replicated when tp_size is a multiple of num_kv_heads)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an int in [0, tp_size={tp_size}), got {tp_rank!r}")
    for field in ("num_heads", "ffn_hidden"):
        value = getattr(config, field)
        if value % tp_size:
            raise ValueError(f"{field}={value} must be divisible by tp_size={tp_size}")
    kv = config.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"num_kv_heads={kv} must be divisible by tp_size={tp_size}, or divide it (each kv "
            "head is then replicated on tp_size / num_kv_heads ranks)"
        )


def check_model(config: ModelConfig, tp: int, num_stages: int) -> None:
    """ValueError unless the model splits into num_stages stages of tp shards."""
    if config.num_layers < num_stages:
        raise ValueError(
            f"--layers {config.num_layers} is fewer than the schedule's {num_stages} stages; "
            f"every stage needs a layer, so use at least {num_stages} layers"
        )
    check_tp(config, tp, 0)


def set_recompute(units: Iterable[Unit], mode: str) -> str:
    """Give every unit (and a layer chunk's layers) the recomputation mode `mode`
    (stp.models.recompute; ValueError naming the modes for another)."""
    check_recompute(mode)
    for unit in units:
        for part in (unit, *getattr(unit, "parts", ())):
            part.recompute = mode
    return mode


def set_overlap(units: Iterable[Unit], chunks: int, recompute: str) -> int:
    """In-layer TP overlap in `chunks` chunks (stp.models.decoder.chunked) for every
    attention and MLP unit that runs sequence parallelism (none at one TP rank, where
    it has no collective to cut); 0: off. ValueError where it cannot run."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
        raise ValueError(f"tp_overlap_chunks must be an integer >= 0 (0: off), got {chunks!r}")
    regions = [u for u in units if isinstance(u, ChunkedRegion) and u.seq is not None]
    if chunks and regions and recompute == "full":
        raise ValueError("--tp-overlap does not run with --recompute full (its forward runs "
                         "again in B, unchunked); use --recompute selective or none")
    for unit in regions:
        unit.overlap = chunks
    return chunks


def with_tp_overlap(build: Callable[..., Any], chunks: int) -> Callable[..., Any]:
    """A stage builder whose stages run in-layer TP overlap in `chunks` chunks."""
    def build_overlapped(*args: Any, **kwargs: Any) -> Any:
        stage = build(*args, **kwargs)
        stage.tp_overlap_chunks = set_overlap(stage.units, chunks, stage.recompute)
        return stage
    return build_overlapped
