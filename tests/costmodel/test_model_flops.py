"""Training FLOPs of a whole model (MFU's numerator, stp.costmodel.families.model_flops)
against hand counts: matmuls only, 2 FLOPs a multiply-add, F + B + W = 3 forwards
(the patch embedding 2: pixels need no gradient), attention over the full s x s."""

from __future__ import annotations

from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.families import model_flops
from stp.costmodel.mllm.spec import MLLMSpec
from stp.plan.price import model_flops_per_sequence


def test_decoder_by_hand_and_as_stp_plan_counts_it():
    spec = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=50, sequence=8,
                     micro_batch=3, tp=4, gated_mlp=True, recompute="full")
    s, h = 8, 32
    # q, kv (2 heads of 8), o, SwiGLU, attention's two products
    macs = s * h * h + s * h * 32 + s * h * h + 3 * s * h * 64 + 2 * s * s * h
    per_sequence = 3 * 2 * (2 * macs + s * h * 50)
    # the microbatch's 3 sequences; unsharded and without the recomputed forward
    assert model_flops(spec) == 3 * per_sequence
    assert model_flops_per_sequence(spec, 8) == per_sequence  # the figure stp plan divides


def test_multimodal_by_hand():
    spec = MLLMSpec(layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=50, sequence=8,
                    vision_layers=1, vision_hidden=16, vision_heads=2, vision_mlp=32, patch=2,
                    merge=2, images=1, resolution=8)
    # 16 patches of 2 x 2 pixels, 4 image tokens before the 8 text tokens: 12 positions
    decoder = 3 * 2 * (12 * 32 * 32 * 3 + 3 * 12 * 32 * 64 + 2 * 12 * 12 * 32)
    head = 3 * 2 * 12 * 32 * 50
    vision = 3 * 2 * (4 * 16 * 16 * 16 + 2 * 16 * 16 * 32 + 2 * 16 * 16 * 16)
    merger = 3 * 2 * (4 * 64 * 64 + 4 * 64 * 32)
    patch_embed = 2 * 2 * (16 * (3 * 2 * 2 * 2) * 16)  # 3 channels x 2 frames x 2 x 2 pixels
    assert model_flops(spec) == decoder + head + vision + merger + patch_embed == 1_251_840
