"""Model + hardware + pipeline size -> the simulator's costs and memory units,
and the `--model` / `--hardware` text a user gives for them.

`derive` hands a spec to its own cost functions (stp.costmodel.families): a
decoder's in stp.costmodel.decoder.costs (whose doc gives the formulas: times
of one rank's share in milliseconds, memory in units of its M_B, PipeOffload's
offload ratio), a multimodal model's in stp.costmodel.mllm.costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from stp.costmodel.decoder.costs import Derived
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.families import costs_of
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.mllm.spec import MLLM_MODELS, MLLMSpec
from stp.costmodel.presets import HARDWARE, MODELS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Derived", "derive", "parse_model", "parse_hardware"]

_Spec = TypeVar("_Spec", bound="DataclassInstance")


def derive(model: ModelSpec | MLLMSpec, hardware: HardwareSpec, pp: int) -> Derived:
    """Per-rank costs of `model` cut into `pp` pipeline ranks on `hardware` (the
    spec's own: stp.costmodel.families)."""
    return costs_of(model).derive(model, hardware, pp)


def _convert(cls: type, key: str, raw: str, what: str) -> object:
    types = {fl.name: fl.type for fl in fields(cls)}
    if key not in types:
        raise ValueError(f"unknown {what} key {key!r}; accepted: {', '.join(types)}")
    kind = types[key]
    try:
        if kind in ("int", "int | None"):
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return low in ("1", "true", "yes", "on")
    except ValueError:
        raise ValueError(f"{what} {key}={raw!r} is not a valid {kind}") from None
    return raw


def _parse(text: str, presets: Mapping[str, _Spec], cls: type[_Spec], what: str) -> _Spec:
    """`NAME`, `NAME,key=val,...` or `key=val,...` (all fields given)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"empty --{what}; give a preset ({', '.join(presets)}) or key=value items")
    base = None
    if "=" not in items[0]:
        name = items.pop(0)
        if name not in presets:
            raise ValueError(f"unknown {what} preset {name!r}; choose one of: {', '.join(presets)}")
        base = presets[name]
        cls = type(base)  # a preset's own fields (a mixture of experts': experts, ep, ..)
    vals: dict[str, Any] = {}  # each of the field's own type, by _convert
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"{what} item {item!r} is not KEY=VALUE")
        vals[key.strip()] = _convert(cls, key.strip(), raw.strip(), what)
    if base is not None:
        return replace(base, **vals)
    try:
        return cls(**vals)
    except TypeError as e:
        raise ValueError(
            f"--{what} without a preset needs every required field: {e}; or start with one "
            f"of: {', '.join(presets)}"
        ) from None


def parse_model(text: str) -> ModelSpec | MLLMSpec:
    """`qwen2-12.1b,sequence=6144,tp=8` -> ModelSpec (preset names in MODELS);
    `mllm-qwen2vl-7b,images=2` -> MLLMSpec (preset names in MLLM_MODELS)."""
    first = text.split(",", 1)[0].strip()
    if first in MLLM_MODELS:
        return _parse(text, MLLM_MODELS, MLLMSpec, "model")
    every: dict[str, ModelSpec | MLLMSpec] = {**MODELS, **MLLM_MODELS}
    return _parse(text, every, ModelSpec, "model")


def parse_hardware(text: str) -> HardwareSpec:
    """`a800-80g,efficiency=0.45` -> HardwareSpec (preset names in HARDWARE)."""
    return _parse(text, HARDWARE, HardwareSpec, "hardware")
