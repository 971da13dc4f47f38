"""The offload host pool (stp.runtime.host_pool) on host slabs (pin=False: this
checks the allocator, which is the same code a CUDA run pins)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from stp.runtime.host_pool import ALIGN, HostPool


def test_blocks_do_not_overlap_and_keep_their_bytes():
    pool = HostPool(1 << 16, pin=False)
    sizes = [100, 4096, 1, 5000, 777, 30000]
    blocks = [pool.take(n) for n in sizes]
    for i, b in enumerate(blocks):
        assert b.numel() == sizes[i] and b.dtype == torch.uint8
        b.fill_(i + 1)
    for i, b in enumerate(blocks):  # no block wrote over another
        assert bool((b == i + 1).all())
    assert pool.in_use == sum(-(-n // ALIGN) * ALIGN for n in sizes)


def test_a_dropped_block_is_reused_and_ranges_merge():
    pool = HostPool(8 * ALIGN, pin=False)
    a, b, c = pool.take(ALIGN), pool.take(2 * ALIGN), pool.take(ALIGN)
    del a, c
    gc.collect()
    del b  # its neighbours are free: the three merge with the slab's tail
    gc.collect()
    assert pool.in_use == 0
    whole = pool.take(8 * ALIGN)  # fits only if every range merged back
    assert len(pool.slabs) == 1
    del whole


def test_pinning_grows_geometrically_not_per_request():
    """Many first-step requests pin a handful of slabs (log2 of the bytes held over
    the first slab), where one buffer per storage would pin once per request."""
    pool = HostPool(1 << 12, pin=False)
    rng = random.Random(0)
    held = [pool.take(rng.randrange(1, 1 << 14)) for _ in range(300)]
    total = sum(b.numel() for b in held)
    assert pool.pinned_bytes >= total
    assert len(pool.slabs) <= 2 + (total // (1 << 12)).bit_length()
    del held
    gc.collect()
    assert pool.in_use == 0
    slabs = len(pool.slabs)
    again = [pool.take(rng.randrange(1, 1 << 12)) for _ in range(300)]  # a later step
    assert len(pool.slabs) == slabs and len(again) == 300


def test_bad_size_is_refused():
    with pytest.raises(ValueError, match="initial_bytes"):
        HostPool(0, pin=False)
