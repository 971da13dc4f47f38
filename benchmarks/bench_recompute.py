"""Activation recomputation's resident bytes, measured on the CPU next to the cost
model's estimate (not a timed test).

Trains a small decoder on pp x tp gloo ranks (default pp2 x tp2, the V-shaped
stp schedule, float32) for one step with `recompute` none, selective and full,
and prints per rank the step's peak resident activation bytes
(`Trainer.memory.peak_bytes`: what every held microbatch's units keep, the
storages autograd saved behind them, and the split backward's W store;
stp.runtime.offload) next to `stp.costmodel.memory.estimate`'s activation peak
for that pipeline rank with the same Features (dtype, recompute; flash
attention, as the runtime's F.scaled_dot_product_attention is on the CPU too).
The ratio column is measured / estimated; the last two columns are the estimate
with what stp's own units keep (`Features(runtime="stp")`, stp.costmodel.decoder.kept:
what `stp memory` gives a `stp train` run) and measured / that.

    python3 benchmarks/bench_recompute.py [--pp 2] [--tp 2] [--schedule stp] \
        [--seq-len 128] [--hidden 128] [--layers 4] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from _ranks import join_world, run_ranks

MODES = ("none", "selective", "full")


def _config(args: argparse.Namespace):
    from stp.models import ModelConfig

    return ModelConfig(vocab_size=256, hidden=args.hidden, num_layers=args.layers,
                       num_heads=8, num_kv_heads=4, ffn_hidden=2 * args.hidden,
                       max_seq_len=args.seq_len, seed=0)


def _measure(args: argparse.Namespace) -> dict[str, int]:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(args.pp, args.tp, 1), timeout=300)
    gen = torch.Generator().manual_seed(0)
    rows = args.microbatches * args.microbatch_size
    tokens = torch.randint(0, 256, (rows, args.seq_len + 1), generator=gen)
    out = {}
    for mode in MODES:
        tr = Trainer(_config(args), lambda ps: torch.optim.SGD(ps, lr=1e-3), args.schedule,
                     mesh=mesh, microbatches=args.microbatches, offload="none",
                     recompute=mode, timeout=300)
        tr.step((tokens[:, :-1], tokens[:, 1:]))
        out[mode] = tr.memory.peak_bytes
    return out


def _estimates(args: argparse.Namespace, runtime: str = "megatron") -> dict[str, list[float]]:
    """The cost model's activation peak of every pipeline rank, per mode: with
    Korthikanti's per-layer counting (`megatron`) or what stp's own units keep
    (`stp`, stp.costmodel.decoder.kept: the estimate `stp memory` gives a `stp train` run)."""
    from stp.costmodel import HARDWARE
    from stp.costmodel.configs import spec_from_config
    from stp.costmodel.memory import Features, Layout, estimate

    spec = spec_from_config(_config(args), seq_len=args.seq_len,
                            microbatch_size=args.microbatch_size, tp=args.tp,
                            flash_attention=True)
    layout = Layout(pp=args.pp, tp=args.tp, dp=1, microbatches=args.microbatches,
                    microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                    schedule=args.schedule)
    return {mode: [r.activations_peak for r in estimate(
        spec, HARDWARE["a100-80g"], layout, Features(dtype="float32", recompute=mode,
                                                      runtime=runtime)).ranks]
        for mode in MODES}


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    world = args.pp * args.tp
    join_world(rank, port, world, timeout=600)
    queue.put((rank, _measure(args)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--schedule", default="stp")
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    world = args.pp * args.tp
    measured = run_ranks(_worker, world, args, timeout=1200)
    est, units = _estimates(args), _estimates(args, "stp")
    lines = [f"pp={args.pp} tp={args.tp} schedule {args.schedule} m={args.microbatches} "
             f"microbatch {args.microbatch_size} seq {args.seq_len} hidden {args.hidden} "
             f"layers {args.layers} heads 8 kv 4 ffn {2 * args.hidden} vocab 256, float32",
             "",
             "| rank (pp, tp) | recompute | measured peak bytes | estimated bytes | "
             "measured / estimated | stp units' estimate | measured / stp units' |",
             "|---|---|---|---|---|---|---|"]
    for rank in sorted(measured):
        pp = rank // args.tp  # Mesh rank order: tp fastest (stp.runtime.mesh)
        for mode in MODES:
            got, want, ours = measured[rank][mode], est[mode][pp], units[mode][pp]
            lines.append(f"| {rank} ({pp}, {rank % args.tp}) | {mode} | {got:,} | "
                         f"{want:,.0f} | {got / want:.2f} | {ours:,.0f} | {got / ours:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
