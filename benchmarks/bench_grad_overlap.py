"""The DP gradient reduction overlapped with the backward, measured on the CPU (not a
timed test): step time with and without `overlap_grad_sync` at pp2 x dp2.

Four gloo processes run emulated compute (stp.models.emulated: every unit a
timed wait, so the ranks do not fight the gloo threads for the cores and the
overlap is what is measured), each stage holding one real fp32 parameter of
`--params` elements whose gradient the DP all-reduce (or with `--shard` the
reduce-scatter) carries. Both trainers live in the same processes and their
steps alternate (round r: on, off, on, off, ...), so load on the machine
hits both alike; the figure is the median step of each. Printed beside it:
the simulator's price of the same step (stp.sim.dp_overlap) for the
reduction time measured alone.

    PYTHONPATH=src python3 benchmarks/bench_grad_overlap.py [--schedules 1f1b,zb-v]
        [--params 4000000] [--cost f=20,b=20,w=20] [-m 4] [--steps 8] [--shard]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _ranks import join_world, run_ranks
from torch import nn

HIDDEN, SEQ, LAYERS = 64, 16, 4


def _builder(costs, chunks: int, params: int):
    from stp.models.emulated import emulated_builder

    inner = emulated_builder(costs, chunks, LAYERS, HIDDEN)

    def build(stage: int, num_stages: int, **kw):
        st = inner(stage, num_stages, **kw)
        # what the DP reduction carries: a stage's gradients (never touched: zeros)
        st.register_parameter(f"weight{stage}", nn.Parameter(torch.zeros(params)))
        return st

    return build


def _step_times(args: argparse.Namespace, schedule: str) -> dict[str, list[float]]:
    from stp.models.emulated import parse_emulate
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.schedule import registry
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(2, 1, 2), timeout=300)
    sch = registry.make(schedule, 2, args.m)
    costs = parse_emulate(args.cost)
    trainers = {
        mode: Trainer(_builder(costs, sch.chunks, args.params),
                      lambda ps: torch.optim.SGD(ps, lr=0.0), sch, mesh=mesh,
                      hidden=HIDDEN, timeout=300, shard_optimizer=args.shard,
                      overlap_grad_sync=mode == "on")
        for mode in ("on", "off")}
    rows = 2 * args.m
    batch = (torch.zeros(rows, SEQ, dtype=torch.long), torch.zeros(rows, SEQ, dtype=torch.long))
    times: dict[str, list[float]] = {"on": [], "off": []}
    for step in range(args.steps):
        for mode, trainer in trainers.items():
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(batch)
            if step >= 1:  # the first step allocates
                times[mode].append(time.perf_counter() - t0)
    flat = torch.zeros(args.params)  # one stage's reduction alone, for the price
    dist.barrier()
    alone = []
    for _ in range(3):
        t0 = time.perf_counter()
        dist.all_reduce(flat, group=mesh.dp_group)
        alone.append(time.perf_counter() - t0)
    times["alone"] = [statistics.median(alone)]
    return times


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    join_world(rank, port, 4, timeout=300)
    out = {s: _step_times(args, s) for s in args.schedules.split(",")}
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _predicted(schedule: str, args: argparse.Namespace, reduce_s: float) -> tuple[float, float]:
    """(simulated step with the overlap, without), seconds, the reduction `reduce_s`."""
    from stp.models.emulated import parse_emulate
    from stp.schedule import registry
    from stp.sim import Costs, simulate
    from stp.sim.dp_overlap import dp_timeline

    costs = parse_emulate(args.cost)
    ms = {k: 1e3 * getattr(costs, k) for k in ("f", "b", "w")}
    res = simulate(registry.make(schedule, 2, args.m), Costs(**ms))
    owner = res.schedule.stage_to_rank
    out = []
    for overlap in (True, False):
        ends = [dp_timeline(r.grads_final, {s: 1e3 * reduce_s for s, o in enumerate(owner)
                                            if o == r.rank}, r.end, overlap=overlap).end
                for r in res.ranks]
        out.append(max(ends) / 1e3)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,zb-v")
    ap.add_argument("--params", type=int, default=4_000_000,
                    help="fp32 elements of each stage's gradient")
    ap.add_argument("--cost", default="f=20,b=20,w=20",
                    help="emulated ms of F, B, W per microbatch per rank share")
    ap.add_argument("-m", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--shard", action="store_true", help="the sharded optimizer")
    args = ap.parse_args()
    results = run_ranks(_worker, 4, args, timeout=1800)
    print(f"pp2 x dp2, emulated compute {args.cost} ms, m {args.m}, {args.params:,} fp32 "
          f"gradient elements per stage, {'reduce-scatter' if args.shard else 'all-reduce'}, "
          f"{args.steps - 1} steps each, alternating; rank 0's step times (every rank ends "
          "each step with the same loss all-reduce)")
    print("| schedule | overlap on (median) | off (median) | saved | one stage's reduction "
          "alone | simulated on / off |")
    print("|---|---|---|---|---|---|")
    for schedule in args.schedules.split(","):
        r = results[0][schedule]
        on, off = statistics.median(r["on"]), statistics.median(r["off"])
        alone = max(res[schedule]["alone"][0] for res in results.values())
        p_on, p_off = _predicted(schedule, args, alone)
        print(f"| {schedule} | {on * 1e3:.1f} ms | {off * 1e3:.1f} ms | "
              f"{(off - on) * 1e3:.1f} ms ({(off - on) / off:.1%}) | {alone * 1e3:.1f} ms | "
              f"{p_on * 1e3:.1f} / {p_off * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
