"""Parameters held in more than one place, kept equal by summing their gradients.

- A tied embedding and head (`tie_embeddings`): stage 0 holds `embed.weight`,
  the last stage `head.weight`, both initialised or loaded with one value.
  After each step's backward their gradients are summed, so both copies take
  the same optimizer step, as Megatron-LM does with its embedding group (an
  all-reduce between the first and last pipeline ranks). Here the two ranks
  exchange their gradients point to point; when one pipeline rank holds both
  stages (a V-shaped schedule puts stage 0 and the last stage on rank 0) the
  sum is local.
- Replicated kv heads (fewer kv heads than TP ranks): tp / num_kv_heads ranks
  hold each kv head and each saw only its own query heads; one sum all-reduce
  over the TP group adds the copies (every rank writes its gradient into its
  head's place of a zero buffer the size of the full tensors).

- Norm gains under sequence parallelism: each TP rank normalises only its s/t
  rows of the sequence, so its gain gradient sums over those rows; one sum
  all-reduce over the TP group makes the whole sequence's (Megatron-LM does the
  same for its sequence-parallel layernorm weights; Korthikanti et al., arXiv
  2205.05198, section 4.2.2). Every parameter replicated over TP is such a gain.

The sums come before the data-parallel average; they commute with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from stp.models.decoder.init import ShardSlice
from stp.shapes.decoder import ModelConfig

__all__ = ["SharedGrads"]


class SharedGrads:
    """Call once per step on every rank, after the backward and before the optimizer,
    with this rank's gradients by global name (summed in place).

    `stages`: this rank's ModelStages by global stage index; `embed_rank` /
    `head_rank`: the pipeline ranks holding stage 0 and the last stage; `peer`:
    the global rank of the other one of the two; the groups are this rank's."""

    def __init__(
        self,
        config: ModelConfig,
        stages: Mapping[int, Any],
        *,
        num_stages: int,
        pp_rank: int,
        embed_rank: int,
        head_rank: int,
        peer: int,
        pp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
    ) -> None:
        self.tied = config.tie_embeddings
        self.holds_embed = self.tied and 0 in stages
        self.holds_head = self.tied and num_stages - 1 in stages
        self.exchange = self.tied and embed_rank != head_rank and pp_rank in (embed_rank,
                                                                              head_rank)
        self.peer, self.pp_group, self.tp_group = peer, pp_group, tp_group
        self.replicated: dict[str, tuple[tuple[int, ...], ShardSlice]] = {}
        for st in stages.values():
            if config.kv_replicas(st.tp_size) > 1:
                for name, spec in st.specs.items():
                    if spec.tp_split == "kv_heads":
                        self.replicated[name] = (spec.shape, st.shard_slice(name))
        self.row_sums = [name for st in stages.values() if getattr(st, "sequence_parallel", False)
                         for name, spec in st.specs.items() if spec.shard_dim is None]
        """Parameters whose gradient each TP rank took over its sequence rows only."""

    @classmethod
    def on_mesh(cls, config: ModelConfig, stages: Mapping[int, Any], schedule: Any,
                mesh: Any) -> SharedGrads:
        """For this rank's `stages` of `schedule` (stp.schedule.Schedule) on `mesh`
        (stp.runtime.mesh.Mesh)."""
        c = mesh.coord
        embed_rank, head_rank = schedule.stage_to_rank[0], schedule.stage_to_rank[-1]
        other = head_rank if c.pp == embed_rank else embed_rank
        return cls(config, stages, num_stages=schedule.num_stages, pp_rank=c.pp,
                   embed_rank=embed_rank, head_rank=head_rank, peer=mesh.pp_peer_rank(other),
                   pp_group=mesh.pp_group, tp_group=mesh.tp_group)

    @property
    def names(self) -> frozenset[str]:
        """The parameters whose gradients a call changes (stp.train.step.grad_sync reduces
        the sharded optimizer's shards of these only after the sum)."""
        tied = {"embed.weight"} if self.holds_embed else set()
        tied |= {"head.weight"} if self.holds_head else set()
        return frozenset(self.replicated) | frozenset(self.row_sums) | tied

    def __call__(self, grads: Mapping[str, torch.Tensor]) -> None:
        if self.replicated:
            self._sum_replicas(grads)
        if self.row_sums:
            self._sum_rows(grads)
        if self.holds_embed and self.holds_head:
            grads["embed.weight"].add_(grads["head.weight"])
            grads["head.weight"].copy_(grads["embed.weight"])
        elif self.exchange:
            self._exchange(grads)

    def _sum_replicas(self, grads: Mapping[str, torch.Tensor]) -> None:
        some = next(iter(grads.values()))
        full = {n: torch.zeros(shape, dtype=some.dtype, device=some.device)
                for n, (shape, _) in self.replicated.items()}
        for name, (_, where) in self.replicated.items():
            _rows(full[name], where).copy_(grads[name])
        flat = torch.cat([b.reshape(-1) for b in full.values()])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.tp_group)
        offset = 0
        for name, buf in full.items():
            buf.copy_(flat[offset : offset + buf.numel()].view_as(buf))
            offset += buf.numel()
            grads[name].copy_(_rows(buf, self.replicated[name][1]))

    def _sum_rows(self, grads: Mapping[str, torch.Tensor]) -> None:
        flat = torch.cat([grads[n].reshape(-1) for n in self.row_sums])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.tp_group)
        offset = 0
        for name in self.row_sums:
            g = grads[name]
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _exchange(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Send this copy's gradient to the other rank and add the one received,
        the embedding's first on both ranks so both sums round alike."""
        mine = grads["embed.weight"] if self.holds_embed else grads["head.weight"]
        sent = mine.clone()
        got = torch.empty_like(sent)
        ops = [dist.P2POp(dist.isend, sent, self.peer, group=self.pp_group),
               dist.P2POp(dist.irecv, got, self.peer, group=self.pp_group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if self.holds_embed:
            mine.add_(got)
        else:
            torch.add(got, sent, out=mine)


def _rows(t: torch.Tensor, where: ShardSlice) -> torch.Tensor:
    assert where.dim is not None
    return t.narrow(where.dim, where.start, where.stop - where.start)
