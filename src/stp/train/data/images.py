"""Image-caption data for the multimodal model (stp.shapes.mllm).

Two sources, one batch format:
- `ShapeImages(image_size, seed)`: images that exist on every machine, drawn
  with Pillow from a seed: one to three coloured shapes (circle, square,
  triangle; six colours) at random sizes in distinct quadrants, captioned
  from what was drawn, position first ("a top left red circle, a bottom right
  blue square."), so every word past "a " can only be predicted by looking
  at the image. The position comes first so that the colour and shape are
  read where the caption has already said where to look.
- `ImageFolder(path, image_size)`: a user's images. The directory holds PNG or
  JPEG files and a `captions.txt`, one line per image: the file name (relative
  to the directory), a TAB, the caption (UTF-8, one line). Lines that are
  empty or start with `#` are skipped. Images are converted to RGB and resized
  to image_size x image_size.

`CaptionBatches.batch(step)` gives (inputs, targets): inputs [B, P + T] int64,
the image's P pixel bytes then T caption tokens (bytes: "\\n" + caption,
padded with 0); targets [B, image_tokens + T]: IGNORE_INDEX on the image
positions and on padding, else the next caption byte (the caption ends with
"\\n"). Batch `step` is a function of (seed, step) only. `blank=True` gives
every image as zeros: the caption-only baseline. `in_order=True` takes the
samples in order instead (batch `step` holds samples step*B .. step*B + B - 1,
wrapping round): a held-out set is then covered evenly.

Held-out images: `ShapeImages(held_out=True)` draws from a second stream whose
samples are seeded by keys of another kind (a string, the training stream's
are integers), so no held-out sample is drawn from a training sample's seed;
tiny images can still coincide by chance (an 8-pixel image has few distinct
single shapes). `check_folder` checks a directory before a run reads it.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from PIL import Image, ImageDraw

from stp.shapes.decoder import IGNORE_INDEX
from stp.shapes.mllm import MLLMConfig

__all__ = ["ShapeImages", "ImageFolder", "CaptionBatches", "read_captions", "check_folder",
           "image_choices", "CAPTIONS_FILE"]

CAPTIONS_FILE = "captions.txt"
# six colours with distinct first letters, far apart in RGB
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 230),
           "yellow": (235, 210, 30), "cyan": (40, 210, 220), "purple": (160, 60, 200)}
SHAPES = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
IMAGE_WORDS = frozenset([*COLOURS, *SHAPES, "top", "bottom", "left", "right"])


def image_choices(caption: str) -> list[bool]:
    """Per byte of `caption` (ASCII): True where the image decides the byte (module doc):
    the first byte of an image word, and the byte after a shape word."""
    marks = [False] * len(caption)
    start = 0
    for word in caption.replace(",", " ").replace(".", " ").split(" "):
        at = caption.index(word, start) if word else start
        if word in IMAGE_WORDS:
            marks[at] = True
            if word in SHAPES and at + len(word) < len(caption):
                marks[at + len(word)] = True
        start = at + len(word)
    return marks


class ImageSource(Protocol):
    def __len__(self) -> int: ...

    def sample(self, index: int) -> tuple[np.ndarray, str]:
        """(pixels uint8 [H, W, 3], caption) of sample `index`."""
        ...


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int],
          colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=colour)


@dataclass(frozen=True)
class ShapeImages:
    """Seeded synthetic images of coloured shapes with their captions (module doc)."""

    image_size: int = 32
    seed: int = 0
    size: int = 1 << 30
    """Samples: effectively unlimited, each drawn on demand."""
    held_out: bool = False
    """The held-out stream: samples seeded apart from the training stream's (module doc)."""

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> tuple[np.ndarray, str]:
        # a str seed becomes an integer of over 512 bits (its sha512 appended): no training key
        key = f"held-out {self.seed} {index}" if self.held_out else self.seed * 1_000_003 + index
        rng = random.Random(key)
        s, half = self.image_size, self.image_size // 2
        img = Image.new("RGB", (s, s), (0, 0, 0))
        draw = ImageDraw.Draw(img)
        parts = []
        for q in sorted(rng.sample(range(4), rng.randint(1, 3))):
            colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
            side = rng.randint(max(3, half // 2), half - 1)
            x0 = (q % 2) * half + rng.randint(0, half - side)
            y0 = (q // 2) * half + rng.randint(0, half - side)
            _draw(draw, shape, (x0, y0, x0 + side - 1, y0 + side - 1), COLOURS[colour])
            parts.append(f"a {QUADRANTS[q]} {colour} {shape}")
        return np.asarray(img, dtype=np.uint8), ", ".join(parts) + "."


def read_captions(path: Path, flag: str = "--images") -> list[tuple[str, str]]:
    """(file name, caption) pairs of `path/captions.txt`; ValueError naming `flag` or
    the line."""
    listing = path / CAPTIONS_FILE
    if not listing.is_file():
        raise ValueError(f"{flag} {str(path)!r} needs a {CAPTIONS_FILE} (one 'FILE<TAB>caption' "
                         "line per image)")
    try:
        text = listing.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {listing} as UTF-8 text: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, tab, caption = line.partition("\t")
        if not tab or not caption.strip():
            raise ValueError(f"{listing}:{n}: expected 'FILE<TAB>caption', got {line[:60]!r}")
        if not _inside(path, name):
            raise ValueError(f"{listing}:{n}: image {name!r} resolves outside {str(path)!r} "
                             "(names must be files inside the folder; no '..', absolute paths "
                             "or links leading out)")
        if not (path / name).is_file():
            raise ValueError(f"{listing}:{n}: no image file {name!r} in {str(path)!r}")
        pairs.append((name, caption.strip()))
    if not pairs:
        raise ValueError(f"{flag}: {listing} lists no images")
    return pairs


def _inside(folder: Path, name: str) -> bool:
    """Whether `folder/name` resolves (links followed) to a path inside `folder`: a
    captions.txt from elsewhere may name `../../x` or `/etc/passwd`."""
    root = folder.resolve()
    return (root / name).resolve().is_relative_to(root)


def check_folder(path: str, flag: str) -> None:
    """ValueError naming `flag` unless `path` is a directory whose captions.txt is
    readable and lists at least one image, every one of which lies inside the folder and
    decodes whole as an image. Every pixel is decoded here, before any worker starts (a
    held-out set is read first after some steps of training; a truncated file fails only
    when its pixels are read); Pillow's decompression-bomb limit, raised as an error, keeps
    a hostile header from claiming gigapixels."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{flag} {path!r} is not a directory")
    for name, _ in read_captions(folder, flag):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(folder / name) as im:
                    im.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError,
                Image.DecompressionBombWarning) as e:
            # UnidentifiedImageError is an OSError; a damaged PNG chunk can raise SyntaxError
            raise ValueError(f"{flag}: {str(folder / name)!r} is not a readable PNG/JPEG image "
                             f"({getattr(e, 'strerror', None) or e})") from None


@dataclass(frozen=True)
class ImageFolder:
    """A user's PNG / JPEG images with `captions.txt` (module doc)."""

    path: Path
    image_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_pairs", read_captions(Path(self.path)))

    def __len__(self) -> int:
        return len(self._pairs)  # type: ignore[attr-defined]  # set in __post_init__ of this frozen dataclass

    def sample(self, index: int) -> tuple[np.ndarray, str]:
        name, caption = self._pairs[index % len(self)]  # type: ignore[attr-defined]  # set in __post_init__ of this frozen dataclass
        with Image.open(Path(self.path) / name) as stored:
            im = stored.convert("RGB").resize((self.image_size, self.image_size))
            return np.asarray(im, dtype=np.uint8), caption


@dataclass(frozen=True)
class CaptionBatches:
    """Global batches of (inputs, targets) for the multimodal model (module doc)."""

    source: ImageSource
    config: MLLMConfig
    text_len: int
    batch_size: int
    seed: int = 0
    blank: bool = False
    in_order: bool = False
    """Batch `step` holds samples step*B .. step*B + B - 1, wrapping round (module doc)."""

    def _row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pixels, caption = self.source.sample(index)
        if self.blank:
            pixels = np.zeros_like(pixels)
        text = b"\n" + caption.encode("utf-8") + b"\n"
        t = self.text_len
        tokens = torch.zeros(t, dtype=torch.int64)
        targets = torch.full((self.config.seq_len(t),), IGNORE_INDEX, dtype=torch.int64)
        ids = torch.tensor(list(text[: t + 1]), dtype=torch.int64)
        tokens[: min(t, len(ids))] = ids[:t]
        n = self.config.vision.image_tokens
        targets[n: n + len(ids) - 1] = ids[1:]
        # target n + j is caption byte j
        choices = torch.zeros(targets.shape, dtype=torch.bool)
        # a non-ASCII caption's bytes do not line up with its characters: no marks
        marks = (image_choices(caption) if caption.isascii() else [])[: len(ids) - 1]
        choices[n: n + len(marks)] = torch.tensor(marks, dtype=torch.bool)
        flat = torch.from_numpy(pixels.reshape(-1).astype(np.int64))
        return torch.cat([flat, tokens]), targets, choices

    def image_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global batch `step` (inputs, targets) and a bool mask of the targets the image
        decides (module doc), [B, image_tokens + T]."""
        n, b = len(self.source), self.batch_size
        if self.in_order:
            picks = [(step * b + r) % n for r in range(b)]
        else:
            rng = random.Random(self.seed * 7_919 + step)
            picks = [rng.randrange(n) for _ in range(b)]
        rows = [self._row(i) for i in picks]
        return tuple(torch.stack([r[i] for r in rows]) for i in range(3))  # type: ignore[return-value]  # three stacks: the generator's length is not typed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global batch `step`: its samples are a function of (seed, step)."""
        inputs, targets, _ = self.image_batch(step)
        return inputs, targets
