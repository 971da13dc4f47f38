"""Where the peer benchmark's torch side spends a block's time (benchmarks/results/vs_torch.md,
"Where the time goes").

Two figures, on torchtitan-style blocks of stp's decoder (stp.bench.peer_tp.BlockPart,
two layers, activations [4, seq, hidden], F + B of a summed output, one thread):

  eager / compiled   one process: CPU ms per F + B with the blocks eager and with
                     each block torch.compile'd, and torch.profiler's top ops of each
  dtensor            two processes, tp=2, torchtitan's plan (stp.bench.peer_tp.tp_plan):
                     CPU ms per F + B on rank 0, its cProfile top entries, and the
                     number of collectives waited on per layer and step

    python3 benchmarks/bench_peer_block_profile.py [--hidden 64] [--seq-len 128] [--steps 10]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import pstats
import socket
import sys
import time

LAYERS = range(1, 3)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="profiled steps (timed: 3x as many)")
    args = p.parse_args(argv)
    if args.hidden < 4 or args.hidden % 4 or args.seq_len < 1 or args.steps < 1:
        p.error("--hidden must be a positive multiple of 4 (4 heads), --seq-len and "
                f"--steps positive; got {args.hidden}, {args.seq_len}, {args.steps}")
    return args


def _part(args: argparse.Namespace):
    from stp.bench.peer_tp import BlockPart
    from stp.models import ModelConfig

    config = ModelConfig(hidden=args.hidden, num_layers=4, num_heads=4, num_kv_heads=4,
                         max_seq_len=args.seq_len)
    return BlockPart(config, LAYERS, first=False, last=False)


def _step_fn(part, args: argparse.Namespace):
    import torch

    x0 = torch.randn(4, args.seq_len, args.hidden, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        x = x0.clone().requires_grad_()
        part(x).sum().backward()
    return step


def _cpu_ms(step, n: int) -> float:
    for _ in range(3):
        step()
    start = time.process_time()
    for _ in range(n):
        step()
    return (time.process_time() - start) / n * 1e3


def eager_and_compiled(args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    for compiled in (False, True):
        part = _part(args)
        if compiled:
            for i, block in list(part.layers.items()):
                part.layers[i] = torch.compile(block)
        step = _step_fn(part, args)
        start = time.process_time()
        step()
        first = time.process_time() - start
        ms = _cpu_ms(step, 3 * args.steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        print(f"== {'compiled' if compiled else 'eager'}: F + B of {len(LAYERS)} layers, "
              f"[4, {args.seq_len}, {args.hidden}]: {ms:.2f} ms CPU per step "
              f"(first call {first:.1f} s)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


def _dtensor_rank(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from stp.bench.peer_tp import tp_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        part = _part(args)
        parallelize_module(part, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                           tp_plan(part))
        step = _step_fn(part, args)
        ms = _cpu_ms(step, 3 * args.steps)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        if rank == 0:
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            waits = sum(v[1] for k, v in stats.stats.items() if k[2].endswith("wait_tensor>"))
            stats.sort_stats("tottime").print_stats(14)
            print(f"== dtensor tp2, rank 0: F + B of {len(LAYERS)} layers: {ms:.2f} ms CPU per "
                  f"step; collectives waited on per layer and step: "
                  f"{waits / args.steps / len(LAYERS):.1f}")
            print(out.getvalue(), flush=True)
    finally:
        dist.destroy_process_group()


def dtensor(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dtensor_rank, args=(port, args), nprocs=2)


def main(argv: list[str]) -> int:
    args = _args(argv)
    eager_and_compiled(args)
    dtensor(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
