"""The shape of a multimodal model: a ViT-style vision encoder in front of stp's
decoder (the model family of the STP paper's multimodal experiment, arXiv
2510.27257: a vision transformer feeding a Qwen2-style decoder, after Qwen2-VL,
Wang et al., arXiv 2409.12191).

One sample is an image of `channels x image_size x image_size` pixels and a
caption. The image is cut into `patch_size` patches (the encoder's sequence,
`vision_tokens`); after the encoder, each `merge x merge` window of patches
is concatenated and projected into the decoder's width (Qwen2-VL's patch
merger), giving `image_tokens` decoder positions placed before the caption's
tokens: the decoder sees `image_tokens + text_len` positions.

The first pipeline stage takes ONE int64 tensor per microbatch, [b, P + T]:
the image's P = channels * image_size**2 pixel bytes (0..255, row-major
height x width x channels, as Pillow gives them) followed by the caption's T
token ids. Keeping the stage input a single token-like tensor means the
runtime splits, places and offloads a multimodal batch exactly as a text one.

Between units and across stage boundaries the hidden state stays one
[b, image_tokens + T, hidden] tensor at the decoder's width: before the
merger, the image rows hold the encoder's state of their merge window
(merge**2 * vision width values, zero padded to the decoder width), so the
encoder may span several stages; the merger then replaces them with the
projected image tokens. That asks merge**2 * vision hidden <= hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stp.shapes.decoder import ModelConfig

__all__ = ["VisionConfig", "MLLMConfig"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"VisionConfig.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 32
    """Images are image_size x image_size pixels."""
    patch_size: int = 4
    """Side of one square patch (Qwen2-VL: 14)."""
    channels: int = 3
    """Colour channels (RGB)."""
    hidden: int = 16
    """Encoder width (Qwen2-VL: 1280)."""
    num_layers: int = 2
    """Encoder transformer blocks (Qwen2-VL: 32)."""
    num_heads: int = 2
    """Encoder attention heads (full attention, no causal mask)."""
    mlp_hidden: int | None = None
    """Encoder MLP width; None: 4 x hidden."""
    merge: int = 2
    """merge x merge patches become one decoder token (Qwen2-VL: 2)."""
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "hidden", "num_layers",
                     "num_heads", "merge"):
            _check_int(name, getattr(self, name), 1)
        if self.mlp_hidden is None:
            object.__setattr__(self, "mlp_hidden", 4 * self.hidden)
        _check_int("mlp_hidden", self.mlp_hidden, 1)
        if self.image_size % (self.patch_size * self.merge):
            raise ValueError(
                f"VisionConfig.image_size={self.image_size} must be divisible by patch_size x "
                f"merge = {self.patch_size * self.merge}")
        if self.hidden % self.num_heads:
            raise ValueError(f"VisionConfig.hidden={self.hidden} must be divisible by "
                             f"num_heads={self.num_heads}")

    @property
    def pixels(self) -> int:
        """Pixel bytes of one image (P)."""
        return self.channels * self.image_size**2

    @property
    def patch_dim(self) -> int:
        """Values in one patch: channels x patch_size**2."""
        return self.channels * self.patch_size**2

    @property
    def vision_tokens(self) -> int:
        """Patches of one image: the encoder's sequence length."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        """Decoder positions of one image (after the merge)."""
        return self.vision_tokens // self.merge**2

    @property
    def merged_width(self) -> int:
        """Width of one merge window: merge**2 x hidden."""
        return self.merge**2 * self.hidden

    @property
    def mlp(self) -> int:
        assert self.mlp_hidden is not None
        return self.mlp_hidden


@dataclass(frozen=True)
class MLLMConfig:
    """A vision encoder (`vision`) in front of a decoder (`decoder`). Layers are
    counted together: global layers 0..vision.num_layers-1 are encoder blocks (the
    merger rides with the last), the rest decoder layers, so a pipeline partition
    (stp.schedule.placement) cuts both."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    decoder: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.vision, VisionConfig) or not isinstance(self.decoder, ModelConfig):
            raise ValueError("MLLMConfig takes a VisionConfig and a ModelConfig")
        if self.vision.merged_width > self.decoder.hidden:
            raise ValueError(
                f"merge**2 x vision hidden = {self.vision.merged_width} must be <= the decoder "
                f"hidden {self.decoder.hidden}: the encoder's state crosses stage boundaries "
                "inside the decoder-width hidden tensor")
        if self.decoder.tie_embeddings:
            raise ValueError("MLLMConfig does not support tied embeddings")

    @property
    def num_layers(self) -> int:
        """Encoder blocks plus decoder layers: what a partition splits."""
        return self.vision.num_layers + self.decoder.num_layers

    @property
    def hidden(self) -> int:
        """Width of the hidden state between units and stages (the decoder's)."""
        return self.decoder.hidden

    def seq_len(self, text_len: int) -> int:
        """Decoder positions of a sample with `text_len` caption tokens."""
        return self.vision.image_tokens + text_len

    def text_len(self, input_len: int) -> int:
        """Caption tokens in a first-stage input row of `input_len` values."""
        return input_len - self.vision.pixels
