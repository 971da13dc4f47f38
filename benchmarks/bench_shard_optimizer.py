"""The sharded optimizer's memory, measured on the CPU (not a timed test).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv 1910.02054), section 5.1: with the optimizer states
partitioned over N_d data-parallel ranks, each rank keeps 1 / N_d of them.
This script trains a bfloat16 decoder (fp32 master weights, main grads and
AdamW moments; stp.train.step.precision) on one pipeline rank and dp = 1, 2, 4
ranks (gloo), with `shard_optimizer=True` (at dp 1 it changes nothing), takes
one step so that AdamW's state exists, and prints each rank's measured bytes
(stp.train.run.memory_measure: live tensors, each storage once):

  masters    the fp32 master weights this rank holds
  optimizer  AdamW's exp_avg and exp_avg_sq (and its step counters)
  grads      the whole fp32 main grads (ZeRO stage 1 keeps them)
  weights    the bf16 model (every rank holds all of it)

beside the cost model's estimate (`stp memory --shard-optimizer`,
stp.costmodel.memory), and writes benchmarks/results/shard_optimizer.md.

    python3 benchmarks/bench_shard_optimizer.py [--hidden 256] [--layers 4] [--dp 1,2,4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KEYS = ("masters", "optimizer", "grads", "weights")


def _config(args: argparse.Namespace):
    from stp.models import ModelConfig

    return ModelConfig(vocab_size=256, hidden=args.hidden, num_layers=args.layers,
                       num_heads=8, num_kv_heads=8, max_seq_len=args.seq_len, seed=0)


def _measure(args: argparse.Namespace, dp: int) -> dict[str, int]:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.run.memory_measure import measure
    from stp.train.step.lr import adamw
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(1, 1, dp), timeout=300)
    trainer = Trainer(_config(args), adamw(1e-3), "1f1b", mesh=mesh, microbatches=2,
                      dtype=torch.bfloat16, shard_optimizer=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2 * dp, args.seq_len + 1), generator=gen)
    trainer.step((tokens[:, :-1], tokens[:, 1:]))
    return measure(trainer, None)


def _worker(rank: int, dp: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(dp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=dp,
                            timeout=datetime.timedelta(seconds=300))
    queue.put((rank, _measure(args, dp)))
    dist.barrier()
    dist.destroy_process_group()


def _run(dp: int, args: argparse.Namespace) -> dict[int, dict[str, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, dp, port, args, queue)) for r in range(dp)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return results


def _estimate(args: argparse.Namespace, dp: int) -> dict[str, float]:
    from stp.costmodel import HARDWARE
    from stp.costmodel.configs import spec_from_config
    from stp.costmodel.memory import Features, Layout, estimate

    spec = spec_from_config(_config(args), seq_len=args.seq_len, flash_attention=False)
    est = estimate(spec, HARDWARE["a100-80g"], Layout(pp=1, dp=dp, microbatches=2,
                                                      seq_len=args.seq_len, schedule="1f1b"),
                   Features(dtype="bfloat16", shard_optimizer=True))
    rank = est.ranks[0]
    return {k: getattr(rank, k) for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--dp", default="1,2,4", help="data-parallel sizes, comma-separated")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "shard_optimizer.md"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.dp.split(",")]
    head = (f"bfloat16 decoder: hidden {args.hidden}, {args.layers} layers, vocab 256, "
            "pp 1, tp 1; `shard_optimizer=True`; bytes per rank after one step")
    lines = ["# The sharded optimizer's bytes per rank (ZeRO stage 1)", "",
             "Measured on the CPU with gloo (`python3 benchmarks/bench_shard_optimizer.py`; "
             "stp.train.run.memory_measure), beside the cost model's estimate (`stp memory "
             "--shard-optimizer`).", "", head, "",
             "| dp | rank | masters | optimizer | grads | weights | masters+optimizer / dp 1 "
             "| estimate masters | estimate optimizer |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = None
    for dp in sizes:
        measured, est = _run(dp, args), _estimate(args, dp)
        for rank in sorted(measured):
            m = measured[rank]
            states = m["masters"] + m["optimizer"]
            base = base or states
            lines.append(f"| {dp} | {rank} | {m['masters']:,} | {m['optimizer']:,} | "
                         f"{m['grads']:,} | {m['weights']:,} | {states / base:.3f} | "
                         f"{est['masters']:,.0f} | {est['optimizer']:,.0f} |")
    lines += ["", "masters and optimizer fall by dp (the optimizer's step counters, 4 bytes "
              "per parameter tensor on every rank, are the rest); grads and weights stay "
              "whole (stage 1). The estimate counts parameters, not the step counters."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
