"""Counter-based normal draws: any slice of a seeded tensor, on any device, alone.

A parameter's initial value is a function of (seed, name, flat index) only, so a
rank computes its own TP slice on its own device without the whole tensor (no
full tensor drawn on the CPU, cut and copied over), and the slice equals the same
rows of the whole tensor on every mesh.

Element i of a tensor is component i % 2 of pair i // 2. A pair's 64 random bits
are SplitMix64's output for that counter ("Fast Splittable Pseudorandom Number
Generators", Steele, Lea and Flood, OOPSLA 2014: the golden-gamma increment, then
Stafford's "variant 13" finaliser, as java.util.SplittableRandom) keyed by the
parameter; its two halves are uniforms (0, 1] and [0, 1) made normal by the
Box-Muller transform (cos for the even element, sin for the odd one), in float64,
then rounded to float32. Every step is elementwise on contiguous tensors, so an
element's value does not depend on which slice or chunk computed it. Computing in
float64 is for other devices: their log, cos and sin may differ from the CPU's in
the last bits of a float64, which the float32 rounding hides but for rare ties
(not yet checked on a GPU).

Cost: about 27 elementwise ops per pair. On a GPU that is a few passes over
memory per chunk; on one CPU thread it is 2-3x the time of `torch.randn` for
the same elements (benchmarks/results/startup.md), paid only for this rank's
slice.
"""

from __future__ import annotations

import math

import torch

__all__ = ["normal_slice", "splitmix_key"]

_WRAP = 1 << 64


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch stores (two's complement)."""
    return c - _WRAP if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_LOW32 = (1 << 32) - 1

CPU_CHUNK_PAIRS = 1 << 18
"""Pairs per chunk on the CPU: 2 MiB temporaries, each op long enough to pay its call."""
DEVICE_CHUNK_PAIRS = 1 << 22
"""Pairs per chunk on an accelerator: a few 32 MiB temporaries, few launches."""


def splitmix_key(seed: int) -> int:
    """A parameter's 64-bit key as int64 (its seed is already a hash of name and seed)."""
    return _signed(seed % _WRAP)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    # logical shift: torch shifts int64 arithmetically, so clear the sign's copies
    return (z >> k).bitwise_and_((1 << (64 - k)) - 1)


def _pair_normals(key: int, pairs: torch.Tensor, even: torch.Tensor,
                  odd: torch.Tensor) -> None:
    """even, odd (float32, pairs' shape, any strides) = the normals of the pairs whose
    counters + 1 are `pairs` (int64, overwritten): SplitMix64's state after counter + 1
    steps of its gamma."""
    z = pairs.mul_(_GAMMA).add_(key)  # int64 arithmetic wraps, as SplitMix64's
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    z.bitwise_xor_(_shr(z, 31))
    u1 = _shr(z, 32).add_(1).double().mul_(2.0 ** -32)  # (0, 1]: log is finite
    theta = z.bitwise_and_(_LOW32).double().mul_(2.0 ** -32 * 2.0 * math.pi)
    radius = u1.log_().mul_(-2.0).sqrt_()
    # float64 products rounded to float32 as they are stored
    torch.mul(radius, theta.cos(), out=even)
    torch.mul(radius, theta.sin_(), out=odd)


def _blocks(outer: int, cols: int, chunk: int):
    """(o0, o1, c0, c1) blocks of an [outer, cols] grid of about `chunk` entries."""
    if cols >= chunk:
        for o in range(outer):
            for c in range(0, cols, chunk):
                yield o, o + 1, c, min(c + chunk, cols)
        return
    rows = chunk // max(cols, 1)
    for o in range(0, outer, rows):
        yield o, min(o + rows, outer), 0, cols


def _counters(o0: int, o1: int, c0: int, c1: int, step: int, base: int,
              device: torch.device) -> torch.Tensor:
    """Counter base + o * step + c of each (o, c) in the block, row-major."""
    if o1 - o0 == 1:
        first = base + o0 * step
        return torch.arange(first + c0, first + c1, device=device)
    rows = torch.arange(o0, o1, device=device).mul_(step).add_(base)
    return (rows[:, None] + torch.arange(c0, c1, device=device)[None, :]).view(-1)


def _fill(key: int, grid: torch.Tensor, row: int, first: int) -> None:
    """grid[o, j] = element o * row + first + j of the tensor (grid: [outer, width])."""
    outer, width = grid.shape
    chunk = CPU_CHUNK_PAIRS if grid.device.type == "cpu" else DEVICE_CHUNK_PAIRS
    if row % 2 == 0 and first % 2 == 0 and width % 2 == 0:  # whole pairs: half the draws
        pairs = grid.view(outer, width // 2, 2)
        for o0, o1, c0, c1 in _blocks(outer, width // 2, chunk):
            idx = _counters(o0, o1, c0, c1, row // 2, first // 2 + 1, grid.device)
            block = pairs[o0:o1, c0:c1]
            _pair_normals(key, idx.view(o1 - o0, c1 - c0), block[..., 0], block[..., 1])
        return
    for o0, o1, c0, c1 in _blocks(outer, width, 2 * chunk):  # odd sizes: element-wise
        idx = _counters(o0, o1, c0, c1, row, first, grid.device)
        even, odd = (torch.empty(idx.shape, device=grid.device) for _ in range(2))
        _pair_normals(key, (idx >> 1).add_(1), even, odd)
        grid[o0:o1, c0:c1] = torch.where(idx.bitwise_and_(1).bool(), odd,
                                         even).view(o1 - o0, c1 - c0)


def normal_slice(key: int, shape: tuple[int, ...], dim: int | None, start: int, stop: int,
                 *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows [start, stop) along `dim` (None: the whole tensor) of the standard normal
    float32 tensor of `shape` keyed by `key`, made on `device`."""
    if not shape:
        raise ValueError("normal_slice draws tensors of at least one dimension")
    if dim is None:
        dim, start, stop = 0, 0, shape[0]
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:])
    row = shape[dim] * inner
    out_shape = (*shape[:dim], stop - start, *shape[dim + 1:])
    out = torch.empty(out_shape, dtype=torch.float32, device=device)
    if out.numel():
        # each of the `outer` rows of the tensor holds one contiguous range of the slice
        _fill(key, out.view(outer, (stop - start) * inner), row, start * inner)
    return out
