"""The multimodal model's cost spec from the config a run builds."""

from __future__ import annotations

from stp.costmodel.mllm.spec import MLLMSpec
from stp.shapes.mllm import MLLMConfig

__all__ = ["mllm_spec_from_config"]


def mllm_spec_from_config(config: MLLMConfig, *, seq_len: int, microbatch_size: int = 1,
                          tp: int = 1, flash_attention: bool = True) -> MLLMSpec:
    """One image per sample and the caption's `seq_len` text tokens (`flash_attention`
    aside: the encoder's and decoder's views keep no scores either way). Two things
    the cost model assumes and stp's encoder does not do: Qwen2-VL's patches span two
    video frames (stp's one image) and its decoder heads are re-split to divide by
    tp. Both move every partition's cost alike, so a partition's choice barely
    depends on them."""
    dec, vis = config.decoder, config.vision
    return MLLMSpec(
        layers=dec.num_layers, hidden=dec.num_heads * dec.head_dim, heads=dec.num_heads,
        kv_heads=dec.num_kv_heads, ffn=dec.ffn, vocab=dec.vocab_size, sequence=seq_len,
        vision_layers=vis.num_layers, vision_hidden=vis.hidden, vision_heads=vis.num_heads,
        vision_mlp=vis.mlp, patch=vis.patch_size, merge=vis.merge, images=1,
        resolution=vis.image_size, micro_batch=microbatch_size, tp=tp, name="stp-mllm",
    )
