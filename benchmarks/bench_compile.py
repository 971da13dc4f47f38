"""Eager against `--compile` (stp.models.compile), side by side in one run (not a
timed test).

For each size: one world of pp x tp gloo ranks builds an eager Trainer and a
compiled one of the same model, runs the compiled one's first step (the
compile, reported apart as `compile s`) and one warm-up step of each, then
alternates timed steps eager / compiled for --rounds rounds, so that a load
the machine takes on or sheds meets both alike. Printed per size: the median
step (min-max) of each, rank 0's wall and rank 0's CPU time (the process's,
its communication threads included: on a loaded machine the steadier figure),
and eager / compiled of each (above 1: compiled is faster). A markdown table goes to --out.

    PYTHONPATH=src python3 benchmarks/bench_compile.py \
        [--sizes 256x4x128,512x4x256] [--pp 2] [--tp 1] [--schedule zb-v] [-m 8] \
        [--rounds 5] [--dtype float32] [--out benchmarks/results/compile.md]

A size is HIDDENxLAYERSxSEQ (heads hidden / 64, kv heads half of them, SwiGLU
width 8/3 hidden rounded to 64, byte vocabulary 256).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _ranks import join_world, run_ranks


def _config(hidden: int, layers: int, seq: int):
    from stp.models import ModelConfig

    heads = max(1, hidden // 64)
    return ModelConfig(vocab_size=256, hidden=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=max(1, heads // 2), ffn_hidden=64 * round(hidden * 8 / 3 / 64),
                       max_seq_len=seq, seed=0)


def _size(text: str) -> tuple[int, int, int]:
    hidden, layers, seq = (int(v) for v in text.split("x"))
    return hidden, layers, seq


def _measure(args: argparse.Namespace, size: tuple[int, int, int]) -> dict:
    from stp.models.compile import compile_stats
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer, TrainerOptions

    hidden, layers, seq = size
    mesh = Mesh.from_world(ParallelDims(args.pp, args.tp, 1), timeout=1200)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.microbatches, seq + 1), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    trainers = {
        compiled: Trainer(_config(hidden, layers, seq),
                          lambda ps: torch.optim.SGD(ps, lr=1e-4), args.schedule, mesh=mesh,
                          microbatches=args.microbatches,
                          options=TrainerOptions(dtype=getattr(torch, args.dtype),
                                                 timeout=1200, compile=compiled))
        for compiled in (False, True)}
    before = compile_stats()
    start = time.perf_counter()
    trainers[True].step(batch)  # compiles
    first = time.perf_counter() - start
    compile_s = compile_stats().seconds - before.seconds
    trainers[False].step(batch)  # warm-up
    trainers[True].step(batch)
    steps: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for compiled in (False, True):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            trainers[compiled].step(batch)
            steps[compiled].append(time.perf_counter() - start)
            cpu[compiled].append(time.process_time() - start_cpu)
    return {"eager": steps[False], "compiled": steps[True], "eager_cpu": cpu[False],
            "compiled_cpu": cpu[True], "compile_s": compile_s,
            "first_s": first, "graphs": compile_stats().graphs - before.graphs}


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    world = args.pp * args.tp
    join_world(rank, port, world, timeout=1800)
    out = [_measure(args, _size(s)) for s in args.sizes.split(",")]
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _row(size: str, r: dict, slowest_compile: float) -> str:
    def fmt(xs: list[float]) -> str:
        return f"{1000 * statistics.median(xs):.0f} ({1000 * min(xs):.0f}-{1000 * max(xs):.0f})"

    def ratio(a: str, b: str) -> float:
        return statistics.median(r[a]) / statistics.median(r[b])

    return (f"| {size} | {fmt(r['eager'])} | {fmt(r['compiled'])} | "
            f"{ratio('eager', 'compiled'):.2f} | {fmt(r['eager_cpu'])} | "
            f"{fmt(r['compiled_cpu'])} | {ratio('eager_cpu', 'compiled_cpu'):.2f} | "
            f"{slowest_compile:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256x4x128,512x4x256",
                    help="comma-separated HIDDENxLAYERSxSEQ")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--schedule", default="zb-v")
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    world = args.pp * args.tp
    results = run_ranks(_worker, world, args, timeout=3600)
    lines = [f"{args.schedule} on pp={args.pp} tp={args.tp}, m={args.microbatches} "
             f"microbatches of 1 sequence, {args.dtype}, {args.rounds} alternating rounds, "
             "one thread per rank, gloo on the CPU",
             "",
             "| size (hidden x layers x seq) | eager wall ms/step, median (min-max) | "
             "compiled wall ms/step | eager / compiled | eager CPU ms/step (rank 0) | "
             "compiled CPU ms/step | eager / compiled (CPU) | compile s (slowest rank) |",
             "|---|---|---|---|---|---|---|---|"]
    for i, size in enumerate(args.sizes.split(",")):
        slowest = max(results[r][i]["compile_s"] for r in results)
        lines.append(_row(size, results[0][i], slowest))
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
