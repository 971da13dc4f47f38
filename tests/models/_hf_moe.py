"""Tiny random Qwen2-MoE and Mixtral checkpoints built with transformers (nothing
downloaded), weights re-drawn with visible scales (tests/models/_hf.py: redraw)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _hf import redraw
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM


def qwen2_moe_config(**kw: Any) -> Qwen2MoeConfig:
    """4 experts, top-2 not renormalised, a shared expert, layer 0 dense (sparse step
    2), q/k/v biases, GQA, an odd vocabulary."""
    args = dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                shared_expert_intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=False,
                max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                router_aux_loss_coef=0.02, eos_token_id=2)
    args.update(kw)
    return Qwen2MoeConfig(**args)


def mixtral_config(**kw: Any) -> MixtralConfig:
    """4 experts, top-2 renormalised, every layer routed, GQA."""
    args = dict(vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                tie_word_embeddings=False, router_aux_loss_coef=0.02, eos_token_id=2)
    args.update(kw)
    return MixtralConfig(**args)


def build_moe(kind: str, path: Path, seed: int = 0, **kw: Any) -> torch.nn.Module:
    """A float64 random model of `kind` (qwen2_moe / mixtral) saved to `path`; in eval."""
    cfg = qwen2_moe_config(**kw) if kind == "qwen2_moe" else mixtral_config(**kw)
    cls = Qwen2MoeForCausalLM if kind == "qwen2_moe" else MixtralForCausalLM
    cfg._experts_implementation = "eager"  # the grouped matmul takes no float64
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64)
    redraw(model, seed)
    model.save_pretrained(path)
    return model.eval()


def load_moe(path: Path) -> torch.nn.Module:
    """A saved model back in transformers, float64, eager experts, in eval."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 experts_implementation="eager")
    return model.eval()
