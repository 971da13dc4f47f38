"""One pipeline stage of the multimodal model (stp.shapes.mllm): encoder
blocks and/or decoder layers, cut into units (stp.models.mllm.vision,
stp.models.decoder.units) that the executor runs or braids like the decoder's.

Global layers 0..Lv-1 are encoder blocks (the merger follows the last one, on
the same stage), Lv.. decoder layers; `partition` counts both, so the encoder
may span several stages or share one with the first decoder layers.

With `sequence_parallel` each TP rank holds S/t rows of the packed stream
(image tokens + caption, S = image_tokens + T) between TP regions, and sends
those between stages (stp.models.mllm.rows).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from stp.models.decoder.end_units import LossUnit
from stp.models.decoder.init import ParamSpec, init_full, init_slice, parameter_specs, tp_slice
from stp.models.decoder.stage import ModelStage, check_tp
from stp.models.decoder.units import AttentionUnit, MLPUnit, RopeCache, Unit
from stp.models.mllm.rows import check_mllm_sequence
from stp.models.mllm.vision import MergerUnit, VisionAttentionUnit, VisionMLPUnit
from stp.models.mllm.vision_input import InputUnit
from stp.models.placement import StagePlacement
from stp.models.tp.comm import make_allreduce
from stp.shapes.decoder import IGNORE_INDEX, ModelConfig
from stp.shapes.mllm import MLLMConfig

__all__ = ["MLLMStage", "build_mllm_stage", "check_mllm", "mllm_specs", "mllm_init"]


def vision_block_specs(cfg: MLLMConfig, i: int) -> list[ParamSpec]:
    """One encoder block: qkv and fc1 column-parallel (dim 0), wo and fc2 row-parallel."""
    d, f, p = cfg.vision.hidden, cfg.vision.mlp, f"vision.blocks.{i}."
    return [
        ParamSpec(p + "norm1.weight", (d,), None, "ones"),
        *(ParamSpec(p + f"attn.{w}.weight", (d, d), 0, "normal") for w in ("wq", "wk", "wv")),
        ParamSpec(p + "attn.wo.weight", (d, d), 1, "normal_out"),
        ParamSpec(p + "norm2.weight", (d,), None, "ones"),
        ParamSpec(p + "mlp.fc1.weight", (f, d), 0, "normal"),
        ParamSpec(p + "mlp.fc2.weight", (d, f), 1, "normal_out"),
    ]


def mllm_specs(cfg: MLLMConfig, layers: range | None = None, *, first: bool = True,
               last: bool = True) -> list[ParamSpec]:
    """Specs of global layers `layers` (default all), in model order: the patch and
    position embeddings with the text embedding on the first stage, the merger after
    the last encoder block, the final norm and head on the last stage."""
    vc, lv = cfg.vision, cfg.vision.num_layers
    layers = range(cfg.num_layers) if layers is None else layers
    specs: list[ParamSpec] = []
    if first:
        specs += [ParamSpec("vision.patch_embed.weight", (vc.hidden, vc.patch_dim), 1, "normal"),
                  ParamSpec("vision.patch_norm.weight", (vc.hidden,), None, "ones"),
                  ParamSpec("vision.pos_embed", (vc.vision_tokens, vc.hidden), None, "normal")]
    for i in (i for i in layers if i < lv):
        specs += vision_block_specs(cfg, i)
        if i == lv - 1:
            mw = vc.merged_width
            specs += [ParamSpec("vision.merger.norm.weight", (vc.hidden,), None, "ones"),
                      ParamSpec("vision.merger.fc1.weight", (mw, mw), 0, "normal"),
                      ParamSpec("vision.merger.fc2.weight", (cfg.hidden, mw), 1, "normal")]
    dec = range(max(layers.start, lv) - lv, max(layers.stop, lv) - lv)
    return specs + parameter_specs(cfg.decoder, dec, first=first, last=last)


def _base(cfg: MLLMConfig, spec: ParamSpec) -> ModelConfig:
    """The config a parameter's init reads: the encoder's residual outputs scale by
    the encoder's depth."""
    if spec.name.startswith("vision."):
        return dataclasses.replace(cfg.decoder, num_layers=cfg.vision.num_layers)
    return cfg.decoder


def mllm_init(cfg: MLLMConfig, spec: ParamSpec, dtype: torch.dtype) -> torch.Tensor:
    """The full value of one parameter, seeded by (decoder seed, name) as the decoder's
    (stp.models.init.init_full); the encoder's residual outputs scale by its depth."""
    return init_full(_base(cfg, spec), spec, dtype)


def _shard(cfg: MLLMConfig, spec: ParamSpec, tp_size: int, tp_rank: int,
           device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """This TP rank's slice alone, made on `device` (stp.models.decoder.init.init_slice)."""
    return init_slice(_base(cfg, spec), spec, tp_slice(cfg.decoder, spec, tp_size, tp_rank),
                      device=device, dtype=dtype)


def check_mllm(cfg: MLLMConfig, tp: int, num_stages: int) -> None:
    """ValueError unless the model splits into num_stages stages of tp shards."""
    if cfg.num_layers < num_stages:
        raise ValueError(
            f"{cfg.vision.num_layers} vision + {cfg.decoder.num_layers} decoder layers are fewer "
            f"than the schedule's {num_stages} stages; every stage needs a layer")
    check_tp(cfg.decoder, tp, 0)
    vc = cfg.vision
    for name, value in (("vision heads", vc.num_heads), ("vision MLP width", vc.mlp),
                        ("patch values (channels x patch**2)", vc.patch_dim),
                        ("merged width (merge**2 x vision hidden)", vc.merged_width)):
        if value % tp:
            raise ValueError(f"{name}={value} must be divisible by tp={tp}")


class MLLMStage(ModelStage):
    """Layers of one stage of the multimodal model on one TP rank (a PipelineStage cut
    into units; the decoder stage's protocol methods, other units and input check)."""

    def __init__(self, cfg: MLLMConfig, placement: StagePlacement, specs: list[ParamSpec],
                 tensors: dict[str, torch.Tensor]) -> None:
        self.mllm = cfg
        # the input unit (patch and text embeddings) keeps its small inputs either way
        # under recomputation; sequence parallelism: stp.models.mllm.rows
        super().__init__(cfg.decoder, placement, specs, tensors,
                         allreduce=make_allreduce(placement.tp_group, placement.tp_size),
                         async_allreduce=True, fuse_layers=False)

    def _layer_count(self) -> int:
        return self.mllm.num_layers

    def _make_units(self, p: dict[str, nn.Parameter]) -> list[Unit]:
        cfg, dec, lv = self.mllm, self.mllm.decoder, self.mllm.vision.num_layers
        vocab_start = self.tp_rank * (dec.padded_vocab(self.tp_size) // self.tp_size)
        units: list[Unit] = []
        if self.is_first:
            cols = self._slices["vision.patch_embed.weight"]
            span = (0, cfg.vision.patch_dim) if cols.dim is None else (cols.start, cols.stop)
            units.append(InputUnit(cfg, p["vision.patch_embed.weight"], span,
                                   p["vision.patch_norm.weight"], p["vision.pos_embed"],
                                   p["embed.weight"], vocab_start))
        rope = RopeCache(dec.head_dim, dec.rope_theta, dec.rope_scaling)
        for i in self.layer_ids:
            if i < lv:
                units += self._vision_units(i, p)
                continue
            j, a, m = i - lv, f"layers.{i - lv}.attn", f"layers.{i - lv}.mlp"
            biases = (p[f"{a}.wq.bias"], p[f"{a}.wk.bias"], p[f"{a}.wv.bias"]) if (
                dec.qkv_bias) else None
            units.append(AttentionUnit(
                j, p[f"layers.{j}.attn_norm.weight"], p[f"{a}.wq.weight"], p[f"{a}.wk.weight"],
                p[f"{a}.wv.weight"], p[f"{a}.wo.weight"], head_dim=dec.head_dim,
                eps=dec.norm_eps, rope=rope, biases=biases))
            units.append(MLPUnit(j, p[f"layers.{j}.mlp_norm.weight"], p[f"{m}.w1.weight"],
                                 p[f"{m}.w3.weight"], p[f"{m}.w2.weight"], eps=dec.norm_eps))
        if self.is_last:
            part = dec.padded_vocab(self.tp_size) // self.tp_size
            head = self._slices["head.weight"]
            valid = part if head.dim is None else head.stop - head.start
            units.append(LossUnit(p["norm.weight"], p["head.weight"], eps=dec.norm_eps,
                                  vocab_start=vocab_start, tp_size=self.tp_size,
                                  tp_rank=self.tp_rank, vocab_valid=valid))
        return units

    def _vision_units(self, i: int, p: dict[str, nn.Parameter]) -> list[Unit]:
        cfg, b = self.mllm, f"vision.blocks.{i}."
        units: list[Unit] = [
            VisionAttentionUnit(i, cfg, p[b + "norm1.weight"], p[b + "attn.wq.weight"],
                                p[b + "attn.wk.weight"], p[b + "attn.wv.weight"],
                                p[b + "attn.wo.weight"]),
            VisionMLPUnit(i, cfg, p[b + "norm2.weight"], p[b + "mlp.fc1.weight"],
                          p[b + "mlp.fc2.weight"]),
        ]
        if i == cfg.vision.num_layers - 1:
            units.append(MergerUnit(cfg, p["vision.merger.norm.weight"],
                                    p["vision.merger.fc1.weight"], p["vision.merger.fc2.weight"]))
        return units

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        """ValueError unless x (and targets, last stage only) fit this stage."""
        cfg = self.mllm
        if self.is_first:
            text = cfg.text_len(x.shape[-1]) if x.dim() == 2 else 0
            if x.dim() != 2 or x.dtype not in (torch.int32, torch.int64) or text < 1:
                raise ValueError(
                    f"stage 0 of the multimodal model takes int64 [batch, {cfg.vision.pixels} "
                    f"pixel bytes + caption tokens], got {x.dtype} {tuple(x.shape)}")
            seq = cfg.seq_len(text)
            if self.sequence_parallel:
                check_mllm_sequence(cfg, text, self.tp_size)
            if x.device.type == "cpu" and x.numel():
                pix, tok = x[:, : cfg.vision.pixels], x[:, cfg.vision.pixels:]
                if pix.min() < 0 or pix.max() > 255:
                    raise ValueError("pixel bytes must be in [0, 255]")
                if tok.min() < 0 or tok.max() >= cfg.decoder.vocab_size:
                    raise ValueError(f"token ids must be in [0, {cfg.decoder.vocab_size})")
        elif x.dim() != 3 or x.shape[-1] != cfg.hidden:
            raise ValueError(f"stage {self.stage} takes hidden states [batch, seq, {cfg.hidden}], "
                             f"got {tuple(x.shape)}")
        else:  # with sequence parallelism a later stage receives its S/t rows
            seq = x.shape[1] * (self.tp_size if self.sequence_parallel else 1)
        if seq > cfg.decoder.max_seq_len:
            raise ValueError(f"{cfg.vision.image_tokens} image + caption tokens = {seq} exceed "
                             f"max_seq_len={cfg.decoder.max_seq_len}")
        if self.is_last:
            if targets is None or tuple(targets.shape) != (x.shape[0], seq):
                got = None if targets is None else tuple(targets.shape)
                raise ValueError(f"the last stage needs targets of shape {(x.shape[0], seq)} "
                                 f"(image positions {IGNORE_INDEX}), got {got}")
        elif targets is not None:
            raise ValueError(f"stage {self.stage} is not the last stage; it takes no targets")


def build_mllm_stage(cfg: MLLMConfig, placement: StagePlacement) -> MLLMStage:
    """Materialise the stage `placement` names of the multimodal model (a StageBuilder
    for stp.train.Trainer through its family). Sequence parallelism shards the packed
    stream along the sequence (stp.models.mllm.rows; the identity at tp_size 1);
    recomputation reaches the encoder's units too (stp.models.recompute)."""
    if not isinstance(cfg, MLLMConfig):
        raise ValueError(f"cfg must be an MLLMConfig, got {type(cfg).__name__}")
    if not isinstance(placement, StagePlacement):
        raise ValueError(f"placement must be a StagePlacement, got {type(placement).__name__}")
    p = placement
    check_mllm(cfg, p.tp_size, p.num_stages)
    check_tp(cfg.decoder, p.tp_size, p.tp_rank)
    specs = mllm_specs(cfg, p.layers(cfg.num_layers), first=p.is_first, last=p.is_last)
    tensors = {s.name: _shard(cfg, s, p.tp_size, p.tp_rank, p.device, p.dtype) for s in specs}
    return MLLMStage(cfg, p, specs, tensors)
