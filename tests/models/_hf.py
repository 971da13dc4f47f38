"""Tiny random Llama / Qwen2 checkpoints built with transformers (nothing downloaded),
and transformers with its float32 islands (RMSNorm, rotary tables, eager softmax)
replaced by float64 code, for parity to 1e-12 in float64."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0}


def llama_config(**kw: Any) -> LlamaConfig:
    """GQA (4 query heads, 2 kv heads), explicit head_dim 12 != 32 / 4, Llama 3 rope,
    untied head, an odd vocabulary (padded under tp=2), a pad token."""
    args = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    args.update(kw)
    return LlamaConfig(**args)


def qwen2_config(**kw: Any) -> Qwen2Config:
    """q/k/v bias, tied embeddings, one kv head (replicated under tp=2), rope theta 1e6."""
    args = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                tie_word_embeddings=True, eos_token_id=2)
    args.update(kw)
    return Qwen2Config(**args)


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights with scales that make mistakes visible: norm gains in [0.5, 1.5],
    matrices N(0, 1 / sqrt(fan_in)), biases N(0, 0.3), embedding N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * (torch.rand(p.shape, generator=gen, dtype=torch.float64) - .5)
                        * 2)
            elif name.endswith("bias"):
                p.copy_(0.3 * r)
            elif "embed" in name:
                p.copy_(r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))


def build(kind: str, path: Path, seed: int = 0, **kw: Any) -> torch.nn.Module:
    """A float64 random model of `kind` (llama / qwen2) saved to `path`; returned in eval."""
    cfg = llama_config(**kw) if kind == "llama" else qwen2_config(**kw)
    cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64)
    redraw(model, seed)
    model.save_pretrained(path)
    return model.eval()


def _rms_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def _inv_freq64(config: Any) -> torch.Tensor:
    """transformers' inverse frequencies (default and llama3) computed in float64."""
    rp = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rp["rope_type"] != "llama3":
        return inv
    old, lo, hi, f = (rp["original_max_position_embeddings"], rp["low_freq_factor"],
                      rp["high_freq_factor"], rp["factor"])
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / f, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / f + smooth * out
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, out)


def _rotary_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq64
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def float64_everywhere(model: torch.nn.Module) -> torch.nn.Module:
    """Patch this model's RMSNorms and rotary embedding to compute in float64 and use
    sdpa attention (its softmax runs in the input dtype)."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = _rms_forward.__get__(module)
        elif name.endswith("RotaryEmbedding"):
            module.inv_freq64 = _inv_freq64(model.config)
            module.forward = _rotary_forward.__get__(module)
    model.config._attn_implementation = "sdpa"
    return model


SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: pad, bos, eos, unk
WORDS = ["pipeline", "tensor", "stage", "rank", "braid", "schedule", "forward", "backward",
         "weight", "gradient", "all-reduce", "microbatch", "bubble", "memory", "activation",
         "layer", "head", "token", "model", "loss"]


def corpus_text(words: int = 6000, seed: int = 0) -> str:
    """Deterministic text: seeded words, a sentence break every 12."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (words,), generator=gen).tolist()
    return " ".join(WORDS[i] + ("." if k % 12 == 11 else "") for k, i in enumerate(idx))


def save_tokenizer(path: Path, text: str, vocab: int = 96) -> None:
    """A small BPE tokenizer trained on `text` (ids below `vocab`), saved as
    path/tokenizer.json with a tokenizer_config.json naming its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, limit_alphabet=40,
                                  show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"eos_token": "</s>", "pad_token": "<pad>"}')


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             ignore_index=-100)
