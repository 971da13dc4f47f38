"""The names of the model families `stp train` knows, one line per family, and
what of each the flags alone may check: a module of its own, importing nothing,
so that the flags (stp.train.run.config, no torch) list the `--arch` choices
without loading a family."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["EARLY_TP_CHECKS", "MODULES"]

MODULES: Mapping[str, str] = {
    "decoder": "stp.train.families.decoder",
    "mllm": "stp.train.families.mllm",
    "moe": "stp.train.families.moe",
}
"""`--arch` name -> the module whose `FAMILY` it is, one line per family."""

EARLY_TP_CHECKS: Mapping[str, tuple[str, ...]] = {
    "decoder": ("heads", "kv_heads", "ffn"),
    "moe": ("heads", "kv_heads"),
}
"""What of a family's split over --tp `stp.train.run.precheck` may check from the flags
alone, before the family (and torch) loads: its decoder's heads and kv heads, and
the decoder's dense MLP width (an MoE's experts have their own widths; the
multimodal model's encoder its own heads). A family left out is checked only in full."""
