"""`stp train --arch moe`: the decoder with routed experts (stp.models.moe) on text,
its shape from the decoder's flags and --experts, --top-k, --expert-ffn,
--shared-expert-ffn, --moe-every, --aux-loss-coef, or from an --init-from
Qwen2-MoE / Mixtral checkpoint (whose config.json picks this family without
--arch)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from stp.models.moe.family import MOE
from stp.schedule import Schedule
from stp.shapes.decoder import default_ffn_hidden
from stp.shapes.moe import MoEConfig
from stp.train.data.tokens import Tokenizer
from stp.train.families import RunInputs
from stp.train.families.decoder import FAMILY as DECODER_JOB
from stp.train.families.decoder import decoder_config, in_flag_words
from stp.train.run.config import TrainJob
from stp.train.run.pretrained import checkpoint_config

__all__ = ["FAMILY", "MoEJob", "moe_config"]

_FLAGS = {"top_k": "--top-k", "num_experts": "--experts", "moe_every": "--moe-every",
          "shared_expert_ffn": "--shared-expert-ffn", "expert_ffn": "--expert-ffn",
          "num_layers": "--layers"}
_FIELD = re.compile(r"\b(?:MoEConfig\.)?(" + "|".join(_FLAGS) + r")\b(=)?")


def _in_flags(err: ValueError) -> ValueError:
    """`err` with the MoE fields said as the flags (`--top-k 5`, `--experts 4`)."""
    def flag(m: re.Match[str]) -> str:
        return _FLAGS[m.group(1)] + (" " if m.group(2) else "")

    return ValueError(_FIELD.sub(flag, str(in_flag_words(err))))


def moe_config(job: TrainJob, tokenizer: Tokenizer | None) -> MoEConfig:
    """The MoE model the flags describe: the decoder's shape with routed experts."""
    base = decoder_config(job, tokenizer)
    e = job.moe
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    expert_ffn = e.expert_ffn or max(1, default_ffn_hidden(base.hidden) // e.top_k)
    hf_type = "mixtral" if (not e.shared_expert_ffn and e.moe_every == 1) else "qwen2_moe"
    return MoEConfig(**fields, num_experts=e.experts, top_k=e.top_k, expert_ffn=expert_ffn,
                     shared_expert_ffn=e.shared_expert_ffn, moe_every=e.moe_every,
                     norm_topk_prob=True, aux_loss_coef=e.aux_loss_coef, hf_type=hf_type)


class MoEJob:
    name = "moe"
    model = MOE

    def check_flags(self, job: TrainJob) -> None:
        DECODER_JOB.check_flags(job)
        if job.sequence_parallel:
            raise ValueError("--sequence-parallel: --arch moe has no sequence parallelism")
        if job.recompute != "none":
            raise ValueError(f"--recompute {job.recompute}: --arch moe does not recompute "
                             "yet; drop --recompute")

    def config(self, job: TrainJob, tokenizer: Tokenizer | None) -> MoEConfig:
        if job.init_from is not None:
            config = checkpoint_config(job.init_from, job.model)
            if not isinstance(config, MoEConfig):
                raise ValueError(f"--arch moe: --init-from {job.init_from!r} is not a mixture "
                                 "of experts (Qwen2-MoE or Mixtral); drop --arch moe")
            return config
        try:
            return moe_config(job, tokenizer)
        except ValueError as e:
            raise _in_flags(e) from None

    def check_run(self, job: TrainJob, config: MoEConfig, schedule: Schedule) -> None:
        if job.sequence_parallel:
            raise ValueError("--sequence-parallel: the MoE model has no sequence parallelism")
        try:
            self.model.check(config, job.tp, schedule.num_stages)
        except ValueError as e:
            raise _in_flags(e) from None

    def batches(self, run: RunInputs) -> Any:
        return DECODER_JOB.batches(run)

    def eval_batches(self, run: RunInputs) -> Any | None:
        return DECODER_JOB.eval_batches(run)


FAMILY = MoEJob()
