"""Model + hardware + pipeline size -> the simulator's costs and memory units,
and the `--model` / `--hardware` text a user gives for them.

`derive` hands a spec to its own cost functions (stp.costmodel.families: the
decoder's in stp.costmodel.decoder_costs, the multimodal model's in
stp.costmodel.mllm_costs). For a decoder:

What one rank does for one microbatch (its share: `L = layers / pp`
transformer layers, all of its chunks together; `stp.sim.costs`):

    f, b, w   L x (F, B, W FLOPs of a layer, `stp.costmodel.model`) / achieved FLOP/s
    ar        L x 2 all-reduces of the layer output (s b h 16-bit values) in one
              F pass (Megatron-LM TP: after attention and after the MLP; B has the
              same two on the input gradients; Shoeybi et al. 2019, section 3)
    comm      one send of the stage output, s b h 16-bit values (1/t of it per
              TP rank with sequence parallelism, Korthikanti et al. 2023)
    mem       M_B = 1 unit = L x M_B bytes of a layer; M_W as a fraction of it

Times are in milliseconds. The embedding and output layer (vocabulary) sit on
the first and last stage only, so they are not in these uniform costs (the
output layer's forward is reported as `lm_head_ms`); `stp.costmodel.stages`
adds them to the first and last stage of a per-stage cost table, which is
what `--model` simulates, and `--partition auto` balances them by giving
those stages fewer layers, as the Zero Bubble and STP papers do.

The offload ratio of "PipeOffload" (arXiv 2503.01328), `k = T_offload /
T_compute`, is `M_B bytes / host bandwidth` over `f + b + w`: k <= 1 means
every activation can go to host memory and back within its own compute.
"""

from __future__ import annotations

from dataclasses import fields, replace

from stp.costmodel.decoder_costs import Derived
from stp.costmodel.families import costs_of
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.mllm import MLLM_MODELS, MLLMSpec
from stp.costmodel.model import ModelSpec
from stp.costmodel.presets import HARDWARE, MODELS

__all__ = ["Derived", "derive", "parse_model", "parse_hardware"]


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
        if kind == "int":
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


def _parse(text: str, presets: dict, cls: type, what: str) -> object:
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
    vals: dict[str, object] = {}
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
        return _parse(text, MLLM_MODELS, MLLMSpec, "model")  # type: ignore[return-value]
    return _parse(text, {**MODELS, **MLLM_MODELS}, ModelSpec, "model")  # type: ignore


def parse_hardware(text: str) -> HardwareSpec:
    """`a800-80g,efficiency=0.45` -> HardwareSpec (preset names in HARDWARE)."""
    return _parse(text, HARDWARE, HardwareSpec, "hardware")  # type: ignore[return-value]
