"""A multimodal model's shape: a ViT vision encoder in front of a decoder, and
the encoder's FLOPs, activation bytes and weights.

One sample is `images` square images of `resolution` pixels and `sequence`
text tokens. Each image is cut into `patch` x `patch` patches, the encoder's
sequence of `n = (resolution / patch)^2` tokens per image; every encoder
block attends over the patches of its own image (full attention, no causal
mask). After the last block the patch merger concatenates each `merge x
merge` window (`n / merge^2` image tokens, each `merge^2 h_v` wide) and a
2-layer MLP projects it to the decoder width `h`; the decoder then sees
`sequence + images n / merge^2` positions.

Encoder block, one microbatch (`b` samples, `I` images each, `h_v` width,
`f_v` MLP width, `t` TP size; FLOPs count matmuls, 2 per multiply-add, as
`stp.costmodel.decoder.spec`; its GELU MLP has 2 matrices and QKV has 3 h_v wide
outputs):

    linear  L = 2 n I b (4 h_v^2 + 2 h_v f_v)
    attn    A = 4 n^2 I b h_v           (each image's n x n scores and their use)
    F = (L + A) / t    B = (L + 2A) / t    W = L / t

that is, per image token `2 (4 h_v^2 + 2 h_v f_v) + 4 n h_v` forward FLOPs.
Activation bytes are `stp.costmodel.decoder.spec`'s formulas with `n` as the
sequence and `I b` sequences (flash attention: no n^2 term). Merger:
`2 (n / merge^2) I b (merge^2 h_v)(merge^2 h_v + h) / t` FLOPs per pass;
patch embedding: `2 n I b (3 * 2 * patch^2) h_v` in F and in W only (pixels
have no gradient; the 2 is Qwen2-VL's two video frames per patch, an image
repeated).

`mllm-qwen2vl-7b`: Qwen2-VL-7B's published shapes ("Qwen2-VL: Enhancing
Vision-Language Model's Perception of the World at Any Resolution", Wang et
al., arXiv 2409.12191, and its released config): a 675M ViT of 32 blocks,
width 1280, 16 heads, MLP 5120, 14-pixel patches merged 2 x 2, on Qwen2-7B
(hidden 3584, 28 layers, 28 query and 4 key/value heads, SwiGLU FFN 18944,
vocabulary 152064). Images per sample, resolution and text tokens are ours
to choose: `--model mllm-qwen2vl-7b,images=2,resolution=896,sequence=2048`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from stp.costmodel.decoder.spec import ModelSpec, layer_activation_bytes, layer_flops

__all__ = [
    "MLLM_MODELS",
    "MLLMSpec",
    "decoder_view",
    "merger_flops",
    "patch_embed_flops",
    "vision_layer_bytes",
    "vision_layer_flops",
    "vision_parameters",
    "vision_view",
]

FRAMES_PER_PATCH = 2
"""Qwen2-VL patches span two video frames (an image is repeated)."""
CHANNELS = 3


@dataclass(frozen=True)
class MLLMSpec:
    """A vision encoder in front of a decoder-only model, and how one
    microbatch is cut. Decoder fields as `ModelSpec`'s."""

    layers: int
    """Decoder layers."""
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    sequence: int
    """Text tokens per sample (the decoder sees these plus the image tokens)."""
    vision_layers: int
    """Encoder blocks (before the decoder's layers in a partition)."""
    vision_hidden: int
    vision_heads: int
    vision_mlp: int
    patch: int = 14
    """Side of one square patch, pixels."""
    merge: int = 2
    """merge x merge patches become one decoder token."""
    images: int = 1
    """Images per sample."""
    resolution: int = 448
    """Side of one square image, pixels (a multiple of patch x merge)."""
    micro_batch: int = 1
    tp: int = 1
    """TP size of both encoder and decoder."""
    name: str = "custom"

    def __post_init__(self) -> None:
        for fl in fields(self):
            val = getattr(self, fl.name)
            if fl.type == "int" and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
                raise ValueError(f"model {fl.name}={val!r} must be an integer >= 1")
        if self.resolution % (self.patch * self.merge):
            raise ValueError(f"model resolution={self.resolution} must be a multiple of "
                             f"patch x merge = {self.patch * self.merge}")
        decoder_view(self)  # ValueError for shapes or a TP size that cannot split them
        vision_view(self)

    @property
    def patches(self) -> int:
        """Encoder tokens of one image (n)."""
        return (self.resolution // self.patch) ** 2

    @property
    def image_tokens(self) -> int:
        """Decoder positions of all of a sample's images."""
        return self.images * self.patches // self.merge**2

    @property
    def decoder_sequence(self) -> int:
        return self.sequence + self.image_tokens

    @property
    def total_layers(self) -> int:
        """Encoder blocks plus decoder layers: what a partition splits."""
        return self.vision_layers + self.layers


def _tp_heads(heads: int, kv_heads: int, hidden: int, tp: int, what: str) -> tuple[int, int]:
    """Heads of a cost view that `tp` splits. With flash attention the costs
    depend on heads only through `kv_heads x head size`, so splitting each head
    into r narrower ones changes no FLOP or byte: it models every rank doing
    1/t of the attention (Qwen2-7B's 28 heads at tp=8 would really be 4 on some
    ranks and 3 on others)."""
    for r in range(1, tp + 1):
        a, k = heads * r, kv_heads * r
        if hidden % a == 0 and a % tp == 0 and (k % tp == 0 or tp % k == 0):
            return a, k
    raise ValueError(f"model tp={tp} cannot split the {what}'s {heads} heads of width "
                     f"{hidden // heads}; use a TP size that divides {heads}")


def decoder_view(spec: MLLMSpec) -> ModelSpec:
    """The decoder as a `ModelSpec` over all its positions (text and image tokens)."""
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(f"model hidden={spec.hidden}, heads={spec.heads}, kv_heads="
                         f"{spec.kv_heads}: heads must divide hidden and kv_heads divide heads")
    heads, kv = _tp_heads(spec.heads, spec.kv_heads, spec.hidden, spec.tp, "decoder")
    return ModelSpec(
        layers=spec.layers, hidden=spec.hidden, heads=heads, kv_heads=kv, ffn=spec.ffn,
        vocab=spec.vocab, sequence=spec.decoder_sequence, micro_batch=spec.micro_batch,
        tp=spec.tp, gated_mlp=True, flash_attention=True, name=f"{spec.name} decoder",
    )


def vision_view(spec: MLLMSpec) -> ModelSpec:
    """One encoder block as a `ModelSpec`: `n` patches per sequence, one
    sequence per image (`images x micro_batch` of them), GELU MLP, multi-head
    attention; its `vocab` is unused."""
    if spec.vision_hidden % spec.vision_heads:
        raise ValueError(f"model vision_hidden={spec.vision_hidden} must be a multiple of "
                         f"vision_heads={spec.vision_heads}")
    heads, _ = _tp_heads(spec.vision_heads, spec.vision_heads, spec.vision_hidden, spec.tp,
                         "vision encoder")
    return ModelSpec(
        layers=spec.vision_layers, hidden=spec.vision_hidden, heads=heads, kv_heads=heads,
        ffn=spec.vision_mlp, vocab=1, sequence=spec.patches,
        micro_batch=spec.images * spec.micro_batch, tp=spec.tp, gated_mlp=False,
        flash_attention=True, name=f"{spec.name} vision",
    )


def vision_layer_flops(spec: MLLMSpec) -> tuple[float, float, float]:
    """(F, B, W) FLOPs of one encoder block for one microbatch, one TP rank."""
    return layer_flops(vision_view(spec))


def vision_layer_bytes(spec: MLLMSpec) -> tuple[float, float]:
    """(M_B, M_W) activation bytes of one encoder block for one microbatch, one TP rank."""
    return layer_activation_bytes(vision_view(spec))


def merger_flops(spec: MLLMSpec) -> float:
    """FLOPs of the patch merger's two matmuls in one pass (F, B and W each), one TP rank."""
    wide = spec.merge**2 * spec.vision_hidden
    tokens = spec.image_tokens * spec.micro_batch
    return 2.0 * tokens * wide * (wide + spec.hidden) / spec.tp


def patch_embed_flops(spec: MLLMSpec) -> float:
    """FLOPs of the patch embedding in F (and again in W), one TP rank."""
    patch_dim = CHANNELS * FRAMES_PER_PATCH * spec.patch**2
    tokens = spec.images * spec.patches * spec.micro_batch
    return 2.0 * tokens * patch_dim * spec.vision_hidden / spec.tp


def vision_parameters(spec: MLLMSpec) -> int:
    """Weights of the encoder with its patch embedding and merger (biases and
    norms left out: under 0.1%)."""
    h, f = spec.vision_hidden, spec.vision_mlp
    wide = spec.merge**2 * h
    blocks = spec.vision_layers * (4 * h * h + 2 * h * f)
    embed = CHANNELS * FRAMES_PER_PATCH * spec.patch**2 * h
    return blocks + embed + wide * wide + wide * spec.hidden


MLLM_MODELS: dict[str, MLLMSpec] = {
    "mllm-qwen2vl-7b": MLLMSpec(
        layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=152064, sequence=2048,
        vision_layers=32, vision_hidden=1280, vision_heads=16, vision_mlp=5120, patch=14,
        merge=2, images=1, resolution=448, tp=4, name="mllm-qwen2vl-7b",
    ),
}
"""Multimodal presets (`--model NAME[,key=val..]`); shapes in the module doc."""
