"""Sequence parallelism's activation memory, measured on the CPU (not a timed test).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), section 4.2.2: with sequence parallelism the
regions between TP regions (RMSNorm and the residual stream) hold s/t rows per
TP rank, so what they keep for the backward falls by t. This script trains a
decoder on tp ranks (gloo, one pipeline rank, float32, microbatch size 1) with
and without `sequence_parallel` and prints, per TP rank:

  region   bytes one microbatch's forward keeps in the sequence-sharded regions:
           each unit's residual-stream input (x_in), its normalised output (h)
           and what the RMSNorm saved for its backward (xhat, rstd); parameters
           excluded. Expected: divided by tp.
  unit     everything the stage's units keep for that microbatch's backward
           (stp.runtime.offload's accounting: kept tensors and the storages
           autograd saved behind them). It falls by less than t: the TP-sharded
           interior of attention and MLP (heads, MLP width) was already divided
           by t, each unit's partial sum (the graph's root) is full length, and
           the loss head keeps its gathered input (the column-parallel matrices
           of the layers keep only their rows; W gathers them again).
  peak     StepMemory.peak_bytes of a 1f1b step (`Trainer.memory`, offload none).
  p2p      bytes of one hidden-state tensor sent between stages (b x s/t x h).

    python3 benchmarks/bench_sequence_parallel_memory.py [--tp 2] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from _ranks import join_world, run_ranks


def _storages(tensors, exclude: set[int]) -> dict[int, int]:
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if id(s) not in exclude and s.nbytes():
            out[id(s)] = s.nbytes()
    return out


def _measure(args: argparse.Namespace, sp: bool) -> dict[str, int]:
    from stp.models import ModelConfig
    from stp.runtime.graph_saved import graph_saved
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(1, args.tp, 1), timeout=120)
    cfg = ModelConfig(vocab_size=256, hidden=args.hidden, num_layers=args.layers,
                      num_heads=8, num_kv_heads=8, max_seq_len=args.seq_len, seed=0)
    tr = Trainer(cfg, lambda ps: torch.optim.SGD(ps, lr=1e-3), "1f1b", mesh=mesh,
                 microbatches=4, offload="none", sequence_parallel=sp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, args.seq_len + 1), generator=gen)
    tr.step((tokens[:, :-1], tokens[:, 1:]))
    peak = tr.memory.peak_bytes
    # one microbatch's forward through the stage, then what its units keep
    (stage,) = tr.parts.stages.values()
    params = {id(p.untyped_storage()) for p in stage.parameters()}
    ids, tgt = tokens[:1, :-1], tokens[:1, 1:]
    params |= {id(ids.untyped_storage()), id(tgt.untyped_storage())}
    stage.forward(0, ids, tgt)
    region: dict[int, int] = {}
    kept: dict[int, int] = {}
    for unit in stage.units:
        st = unit._states.get(0)
        if st is None:
            continue
        mine = [t for t in unit.kept_tensors(0)]
        kept |= _storages(mine + graph_saved([t for t in mine if t.grad_fn is not None]), params)
        seq = [st.saved[k] for k in ("x_in", "h") if k in st.saved]
        region |= _storages(seq + graph_saved([t for t in seq if t.grad_fn is not None]),
                            params)
    stage.reset()
    return {"region": sum(region.values()), "unit": sum(kept.values()), "peak": peak,
            "p2p": args.seq_len // (args.tp if sp else 1) * args.hidden * 4}


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    join_world(rank, port, args.tp, timeout=300)
    queue.put((rank, {sp: _measure(args, sp) for sp in (False, True)}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    results = run_ranks(_worker, args.tp, args, timeout=600)
    print(f"tp={args.tp} seq={args.seq_len} hidden={args.hidden} layers={args.layers} "
          "float32, microbatch 1, pp=1, schedule 1f1b (m=4)")
    print(f"{'rank':>4} {'what':>7} {'SP off':>12} {'SP on':>12} {'off / on':>9}")
    for rank in sorted(results):
        off, on = results[rank][False], results[rank][True]
        for key in ("region", "unit", "peak", "p2p"):
            print(f"{rank:>4} {key:>7} {off[key]:>12,} {on[key]:>12,} "
                  f"{off[key] / max(on[key], 1):>9.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
