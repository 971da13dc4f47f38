"""The PyTorch side of the peer benchmark (stp.bench.peer): stp's decoder layers as
a plain-autograd module, PyTorch's `PipelineStage`s over it and its schedule
classes, and one training step of that side doing the work `Trainer.step` does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from stp.models import ModelConfig
from stp.models.decoder.init import init_full, parameter_specs
from stp.models.decoder.rope import RopeCache, apply_rope
from stp.models.param_names import register_dotted
from stp.schedule import Schedule
from stp.schedule import io as schedule_io
from stp.schedule.placement import stage_layers
from stp.train.step.clip import grad_norm

__all__ = ["DecoderPart", "refuse_extras", "rms_norm", "lm_loss", "build_torch_stages",
           "torch_schedule", "TorchSide", "TORCH_CLASSES"]

TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "1f1b-interleaved": "ScheduleInterleaved1F1B",
    "zb-v": "ScheduleZBVZeroBubble",
    "looped-bfs": "ScheduleLoopedBFS",
    "zb-interleaved": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""stp schedule name -> PyTorch's class running the same order (pp=2: identical lists;
the last three at every (pp, m) PyTorch accepts, tests/schedule/test_gen_torch.py).
PyTorch runs DualPipeV's OVERLAP_F_B pairs pass after pass; stp braids them."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as a user writes it, statistics in at least float32 (as stp's)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def refuse_extras(config: ModelConfig, who: str) -> None:
    """The torch sides run the plain decoder: refuse the config fields they do not build."""
    extras = [k for k in ("qkv_bias", "tie_embeddings", "pad_token_id")
              if getattr(config, k) not in (None, False)]
    if extras:
        raise ValueError(f"{who} runs the plain decoder; {', '.join(extras)} "
                         "not accepted (leave them at their defaults)")


class DecoderPart(nn.Module):
    """Layers `layers` of the decoder as plain autograd code, parameters under the global
    names and with the initial values of stp's stage (stp.models.decoder.init). The same kernels
    as stp's units (F.linear, SDPA with enable_gqa, RoPE tables of stp.models.decoder.units),
    so both sides do the same FLOPs. first: token ids [b, s] in (embedding); last:
    logits [b, s, V] out (norm and head); else hidden states [b, s, h] in and out."""

    def __init__(self, config: ModelConfig, layers: range, *, first: bool, last: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        refuse_extras(config, "DecoderPart")
        self.config, self.layer_ids, self.first, self.last = config, layers, first, last
        self.p: dict[str, nn.Parameter] = {}
        for spec in parameter_specs(config, layers, first=first, last=last):
            param = nn.Parameter(init_full(config, spec, dtype))
            register_dotted(self, spec.name, param)
            self.p[spec.name] = param
        self.rope = RopeCache(config.head_dim, config.rope_theta, config.rope_scaling)

    def _attention(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p, hd = self.p, self.config.head_dim
        b, s, _ = h.shape
        q = F.linear(h, p[f"layers.{i}.attn.wq.weight"]).view(b, s, -1, hd).transpose(1, 2)
        k = F.linear(h, p[f"layers.{i}.attn.wk.weight"]).view(b, s, -1, hd).transpose(1, 2)
        v = F.linear(h, p[f"layers.{i}.attn.wv.weight"]).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = self.rope.get(s, h.device, h.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), p[f"layers.{i}.attn.wo.weight"])

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = self.p
        gate = F.silu(F.linear(h, p[f"layers.{i}.mlp.w1.weight"]))
        return F.linear(gate * F.linear(h, p[f"layers.{i}.mlp.w3.weight"]),
                        p[f"layers.{i}.mlp.w2.weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, eps = self.p, self.config.norm_eps
        if self.first:
            x = F.embedding(x, p["embed.weight"])  # [b, s] -> [b, s, h]
        for i in self.layer_ids:
            x = x + self._attention(i, rms_norm(x, p[f"layers.{i}.attn_norm.weight"], eps))
            x = x + self._mlp(i, rms_norm(x, p[f"layers.{i}.mlp_norm.weight"], eps))
        if self.last:
            x = F.linear(rms_norm(x, p["norm.weight"], eps), p["head.weight"])  # [b, s, V]
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the microbatch's tokens (stp's loss unit computes the same)."""
    flat = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(flat, targets.flatten())


def build_torch_stages(config: ModelConfig, schedule: Schedule, pp_rank: int,
                       dtype: torch.dtype) -> list[PipelineStage]:
    """PyTorch PipelineStages of pipeline rank pp_rank, one per stage stp places there
    (schedule.stages_of), each holding the layers stp's stage of that index holds."""
    n = schedule.num_stages
    stages = []
    for s in schedule.stages_of(pp_rank):
        part = DecoderPart(config, stage_layers(config.num_layers, s, n),
                           first=s == 0, last=s == n - 1, dtype=dtype)
        stages.append(PipelineStage(part, s, n, torch.device("cpu")))
    return stages


def torch_schedule(name: str, schedule: Schedule, stages: list[PipelineStage],
                   *, from_csv: bool = False) -> Any:
    """PyTorch's schedule class for stp schedule `name` over `stages`, or (from_csv)
    `_PipelineScheduleRuntime` running stp's exported compute-only CSV of `schedule`."""
    m = schedule.num_microbatches
    if from_csv:
        runtime = torch_schedules._PipelineScheduleRuntime(stages, m, loss_fn=lm_loss)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "schedule.csv")
            with open(path, "w") as f:
                f.write(schedule_io.dump_csv(schedule))
            runtime._load_csv(path)
        return runtime
    if name not in TORCH_CLASSES:
        raise ValueError(f"no PyTorch schedule for {name!r}; choose one of: "
                         f"{', '.join(TORCH_CLASSES)} (or from_csv=True)")
    cls = getattr(torch_schedules, TORCH_CLASSES[name])
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, m, loss_fn=lm_loss)


class TorchSide:
    """One rank's PyTorch pipeline; `step` does the work `Trainer.step` does."""

    def __init__(self, name: str, schedule: Schedule, pp_rank: int, config: ModelConfig,
                 dtype: torch.dtype, optimizer: Callable[[list[nn.Parameter]], Any],
                 *, from_csv: bool = False) -> None:
        self.stages = build_torch_stages(config, schedule, pp_rank, dtype)
        self.schedule = torch_schedule(name, schedule, self.stages, from_csv=from_csv)
        mine = schedule.stages_of(pp_rank)
        self.first, self.last = 0 in mine, schedule.num_stages - 1 in mine
        self.m = schedule.num_microbatches
        self.parameters = [p for st in self.stages for p in st.submod.parameters()]
        self.optimizer = optimizer(self.parameters)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [kv for st in self.stages for kv in st.submod.named_parameters()]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One iteration on the batch [m * b, s]; the mean loss, the same on every rank."""
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        total = torch.zeros((), dtype=torch.float64)
        if self.counts_loss():
            total += sum(float(v.detach()) for v in losses) / self.m
        dist.all_reduce(total)
        # The global gradient norm, as stp's Trainer computes it every step (to skip a
        # non-finite step and to log it; torchtitan computes it to clip): same work.
        self.grad_norm = grad_norm(*self.local_grads(), dist.all_reduce)
        self.optimizer.step()
        return float(total)

    def counts_loss(self) -> bool:
        """Whether this rank adds its microbatch losses to the world's sum."""
        return self.last

    def local_grads(self) -> tuple[list[torch.Tensor], list[bool]]:
        """This rank's gradients and whether each counts in the global norm."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        return grads, [True] * len(grads)
