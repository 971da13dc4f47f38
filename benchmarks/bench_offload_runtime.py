"""Activation offload in the runtime, measured on the CPU, next to the simulator.

For each schedule and offload policy, trains a few `stp train`-like steps
(byte-level decoder, AdamW, the standard library's sources) on pp=1 in this
process and on pp=2 in two gloo workers, and prints per rank:

  measured   peak resident activation bytes (stp.runtime.offload: storages
             kept for backward, sampled after every pass and reload)
  predicted  the simulator's peak for the same schedule and plan, in M_B,
             times this rank's measured M_B (bytes one microbatch's forwards
             keep on the rank, from the run without offload). The simulator
             gets M_W / M_B as measured (what B keeps for W) and instant
             copies, as on the CPU; it counts every chunk as M_B / v, so ranks
             whose chunks differ (embedding, loss head) differ a little.
  step       median step time (s) over the timed steps, slowest rank; the
             "off" row runs without the offloader (no measuring), for its cost.
             On a shared CPU the times are noisy: compare them at low load.

`selective:X` is planned with the simulator's default costs (runtime_plan).

    python3 benchmarks/bench_offload_runtime.py [--json] [--steps N] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

SCHEDULES = ("stp", "zb-v", "1f1b")
POLICIES = ("none", "stp", "all", "selective:0.3")


def _measure(pp: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every schedule x policy on this world; returns this rank's figures."""
    import torch

    from stp.models import ModelConfig
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.schedule.registry import make as make_schedule
    from stp.train.data.corpus import ByteBatches, read_corpus
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(pp, 1, 1), timeout=120)
    cfg = ModelConfig(vocab_size=256, hidden=args.hidden, num_layers=args.layers,
                      num_heads=4, num_kv_heads=4, max_seq_len=args.seq_len, seed=0)
    m = 8
    batches = ByteBatches.from_bytes(read_corpus(None), args.seq_len, m * args.mbs, seed=0)
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        sch = make_schedule(name, pp, m)
        for policy in ("off", *POLICIES):
            tr = Trainer(cfg, lambda ps: torch.optim.AdamW(ps, lr=1e-3), sch, mesh=mesh,
                         offload=None if policy == "off" else policy)
            times = []
            for step in range(args.steps + 1):
                start = time.perf_counter()
                tr.step(batches.batch(step))
                times.append(time.perf_counter() - start)
            mem = tr.memory
            if mem is None:
                out[f"{name}/off"] = {"step_s": statistics.median(times[1:])}
                continue
            out[f"{name}/{policy}"] = {
                "peak": mem.peak_bytes,
                "step_s": statistics.median(times[1:]),
                "fwd": sum(mem.forward_bytes.values()) / m,  # M_B of this rank
                "fwd_each": list(mem.forward_bytes.values()),  # one chunk's forward
                "wgt_each": list(mem.weight_bytes.values()),  # one chunk's B -> W
                "offloaded": mem.offloaded_bytes,
            }
    return out


def _worker(pp: int, args: argparse.Namespace) -> dict[str, Any]:
    from stp.runtime.launch import init_distributed

    init_distributed(timeout=120)
    return _measure(pp, args)


def _predict(name: str, pp: int, m: int, policy: str, rank_mb: list[float],
             m_w: float) -> list[float]:
    from stp.runtime.offload import runtime_plan
    from stp.schedule.registry import make as make_schedule
    from stp.sim import MemCosts, OffloadCosts, simulate

    sch = make_schedule(name, pp, m)
    plan = runtime_plan(sch, policy)
    res = simulate(sch, mem=MemCosts(1.0, m_w), offload=plan if len(plan) else None,
                   offload_costs=OffloadCosts(act_bytes=0.0), record_spans=False)
    return [u * b for u, b in zip(res.peak_activation, rank_mb, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=2, help="sequences per microbatch")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from stp.runtime.launch import init_distributed, launch_local

    results: dict[int, list[dict[str, Any]]] = {}
    init_distributed(timeout=120)  # pp=1: this process, a world of one
    results[1] = [_measure(1, args)]
    launched = launch_local(_worker, (2, args), 2)
    if launched.exitcode:
        sys.exit(f"pp=2 workers failed (ranks {launched.failed_ranks})")
    results[2] = [launched.returns[r] for r in range(2)]  # type: ignore[misc]

    rows = []
    for pp, per_rank in results.items():
        for name in SCHEDULES:
            base = [r[f"{name}/none"] for r in per_rank]
            rank_mb = [b["fwd"] for b in base]
            fwd = [x for b in base for x in b["fwd_each"]]
            wgt = [x for b in base for x in b["wgt_each"]]
            m_w = statistics.mean(wgt) / statistics.mean(fwd) if wgt else 0.0
            off = max(r[f"{name}/off"]["step_s"] for r in per_rank)
            rows.append({"pp": pp, "schedule": name, "policy": "off", "step_s": off})
            for policy in POLICIES:
                got = [r[f"{name}/{policy}"] for r in per_rank]
                pred = _predict(name, pp, 8, policy, rank_mb, m_w)
                rows.append({
                    "pp": pp, "schedule": name, "policy": policy, "m_w_over_m_b": m_w,
                    "measured": [g["peak"] for g in got], "predicted": pred,
                    "m_b": rank_mb, "step_s": max(g["step_s"] for g in got),
                    "offloaded": [g["offloaded"] for g in got],
                })
    if args.json:
        print(json.dumps({"config": vars(args), "rows": rows}))
        return
    print(f"decoder h={args.hidden} L={args.layers} s={args.seq_len} b={args.mbs}, m=8, "
          "float32, CPU (gloo); bytes in KiB; M_B per rank from the run without offload")
    head = (f"{'pp':>2} {'schedule':>8} {'policy':>13} {'rank':>4} {'measured':>9} "
            f"{'predicted':>9} {'diff':>6} {'vs none':>7} {'M_B':>8} {'step s':>7}")
    print(head)
    print("-" * len(head))
    none: dict[tuple[int, str], list[int]] = {}
    for row in rows:
        if row["policy"] == "off":
            print(f"{row['pp']:>2} {row['schedule']:>8} {'off':>13} {'all':>4} {'-':>9} "
                  f"{'-':>9} {'':>6} {'':>7} {'':>8} {row['step_s']:>7.3f}")
            continue
        key = (row["pp"], row["schedule"])
        if row["policy"] == "none":
            none[key] = row["measured"]
        for r, (got, pred) in enumerate(zip(row["measured"], row["predicted"], strict=True)):
            cut = got / none[key][r] - 1
            print(f"{row['pp']:>2} {row['schedule']:>8} {row['policy']:>13} {r:>4} "
                  f"{got / 1024:>9.1f} {pred / 1024:>9.1f} {got / pred - 1:>+6.1%} "
                  f"{cut:>+7.1%} {row['m_b'][r] / 1024:>8.1f} {row['step_s']:>7.3f}")


if __name__ == "__main__":
    main()
