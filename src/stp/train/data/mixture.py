"""A weighted mixture of token sources, blended at the packed-sequence level as
Megatron-LM's weighted `--data-path` does.

Rows of the global batch stream (row i of step t is t * batch + i) are dealt in
blocks of BLOCK rows: each block gives every source its share of the block
(largest remainders of weight x BLOCK, ties to the first source), in an order
shuffled by (seed, block). The n-th row a source gets is that source's own n-th
packed sequence (its own seeded permutation, a new one each epoch: a source that
runs out starts its next epoch). So how many rows a source had before any row is
known from the block number alone, and a batch stays a pure function of
(seed, step): the same on every mesh and after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stp.train.data.tokens import TokenBatches

__all__ = ["BLOCK", "MixtureBatches", "block_shares"]

BLOCK = 1024
"""Rows per block: every block holds each source's share to within one row."""
_SOURCE_SEED = 1_009


def block_shares(weights: list[float], block: int = BLOCK) -> list[int]:
    """Rows of each source in one block: floor(w x block), the rows left over to the
    largest remainders (the first source on a tie)."""
    exact = [w * block for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda s: (-(exact[s] - shares[s]), s))
    for s in order[: block - sum(shares)]:
        shares[s] += 1
    return shares


@dataclass
class MixtureBatches:
    """Global batches of `seq_len + 1`-token rows drawn from `sources` by `weights`."""

    sources: list[TokenBatches]
    """One per source, each with its own seed; only their `sequence(n)` is used."""
    weights: list[float]
    seq_len: int
    batch_size: int
    seed: int = 0
    _blocks: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.shares = block_shares(self.weights)

    @staticmethod
    def source_seed(seed: int, index: int) -> int:
        """The seed of source `index`'s own permutation in a mixture seeded `seed`."""
        return seed * _SOURCE_SEED + index + 1

    def _block(self, b: int) -> tuple[list[int], list[int]]:
        """(source of each row, its rank among that source's rows) in block b."""
        if b not in self._blocks:
            labels = [s for s, n in enumerate(self.shares) for _ in range(n)]
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
            order = [labels[k] for k in torch.randperm(BLOCK, generator=gen).tolist()]
            seen = [0] * len(self.shares)
            ranks = []
            for s in order:
                ranks.append(seen[s])
                seen[s] += 1
            self._blocks = {b: (order, ranks)}  # batches are drawn in order: keep one
        return self._blocks[b]

    def source_of(self, row: int) -> tuple[int, int]:
        """(source, that source's sequence number) of global row `row`."""
        b, k = divmod(row, BLOCK)
        order, ranks = self._block(b)
        s = order[k]
        return s, b * self.shares[s] + ranks[k]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each int64 [batch_size, seq_len]; targets shifted by one."""
        first = step * self.batch_size
        rows = []
        for row in range(first, first + self.batch_size):
            s, n = self.source_of(row)
            rows.append(self.sources[s].sequence(n))
        window = torch.stack(rows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
