"""STP on mixtures of experts (simulated): the all-to-all braided like the all-reduce.

DeepSeek's DualPipe exists to hide expert parallelism's all-to-alls under
the compute of another microbatch ("DeepSeek-V3 Technical Report", arXiv
2412.19437, section 3.2.1); STP's braid ("Synergistic Tensor and Pipeline
Parallelism", arXiv 2510.27257) hides the TP all-reduce the same way, and
stp's simulator runs the all-to-all through the same braid rule
(`stp.sim.engine`). This benchmark simulates one training step of the
`mixtral-8x7b` and `qwen2-57b-a14b` presets (`stp.costmodel.presets`, their
published shapes) at EP 8 with TP 1, 2 and 4 on H100 nodes of 8 GPUs, and
compares STP with 1F1B-I, ZB-V and braided DualPipeV:

* PP 4 (two chunks per rank for every schedule: 8 global stages of 4
  layers for Mixtral, 4,4,4,4,3,3,3,3 for Qwen2's 28), m = 16 microbatches
  of one 4096-token sequence (4 per pipeline rank: enough for the steady
  state to dominate, small enough to keep activations near one GPU).
* each stage's pass is cut into two units per layer (attention, MoE), each
  ending with its all-reduce (TP > 1) and one all-to-all: the granularity
  the runtime's units have.
* costs from `stp.costmodel` (h100-80g: 50% of 989 TFLOP/s, 300 GB/s NVLink
  and 50 GB/s network per GPU, both assumed effective one way): at TP 1 the
  EP group of 8 GPUs is one node (NVLink); at TP 2 and 4 it spans 2 and 4
  nodes and most of each all-to-all crosses the network
  (`stp.costmodel.moe`).
* memory: the peak rank's total bytes (`stp.costmodel.memory`: weights,
  gradients, masters and AdamW states with the sharded optimizer over dp 8,
  the experts' over their expert-data-parallel group, peak activations,
  buffers) at dp = ep = 8, bfloat16.

Writes benchmarks/results/moe_sim.md (and prints it).

    python3 benchmarks/bench_moe_sim.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from stp.costmodel import derive, parse_hardware, parse_model
from stp.costmodel.memory import Features, Layout, estimate, format_bytes
from stp.costmodel.stages import layered_costs
from stp.files import write_text_atomic
from stp.schedule import generate
from stp.sim import Costs, simulate
from stp.sim.layered import even_partition

MODELS = ("mixtral-8x7b", "qwen2-57b-a14b")
HARDWARE = "h100-80g"
SCHEDULES = ("stp", "1f1b-interleaved", "zb-v", "dualpipev")
TPS = (1, 2, 4)
EP = PP_DP = 8
PP, MICROBATCHES = 4, 16


def run_setting(model: str, tp: int) -> dict[str, object]:
    spec = parse_model(f"{model},tp={tp},ep={EP}")
    hw = parse_hardware(HARDWARE)
    d = derive(spec, hw, PP)
    row: dict[str, object] = {"model": model, "tp": tp, "costs": d.costs}
    for name in SCHEDULES:
        sch = generate(name, PP, MICROBATCHES)
        counts = even_partition(spec.layers, sch.num_stages)
        units = max(counts)  # two units a layer (attention, MoE)
        table = layered_costs(spec, hw, PP, d.costs, d.mem, layers=units).table(counts)
        res = simulate(sch, d.costs, d.mem, record_spans=False, stages=table)
        crit = res.critical_rank
        mem = estimate(replace(spec, ep=EP), hw,
                       Layout(pp=PP, tp=tp, dp=PP_DP, microbatches=MICROBATCHES,
                              seq_len=spec.sequence, schedule=name, ep=EP),
                       Features(shard_optimizer=True))
        row[name] = {"ms": res.makespan, "a2a": crit.exposed_a2a, "tp": crit.exposed_tp,
                     "idle": crit.idle, "a2a_total": crit.a2a_total,
                     "peak": mem.peak.total, "act": mem.peak.activations_peak}
    return row


def _why(r: dict[str, object]) -> str:
    """What makes STP win or lose against braided DualPipeV, from the critical ranks."""
    s, d = r["stp"], r["dualpipev"]
    assert isinstance(s, dict) and isinstance(d, dict)
    comm = (d["a2a"] + d["tp"]) - (s["a2a"] + s["tp"])
    idle = d["idle"] - s["idle"]
    parts = []
    for gain, what in ((comm, "exposed a2a + AR"), (idle, "pipeline bubble")):
        who = "STP" if gain > 0 else "DualPipeV"
        parts.append(f"{who} {abs(gain):.0f} ms less {what}")
    return "; ".join(parts)


def table(rows: list[dict[str, object]]) -> list[str]:
    out = ["| model | TP | a2a / f (one pass) | STP | 1F1B-I | ZB-V | DualPipeV | STP vs "
           "1F1B-I / ZB-V / DPV | exposed a2a STP / 1F1B-I / ZB-V / DPV | peak memory "
           "STP / 1F1B-I / ZB-V / DPV | STP vs DualPipeV, why |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        c = r["costs"]
        sims = [r[n] for n in SCHEDULES]
        ms = [x["ms"] for x in sims]  # type: ignore[index]
        gains = " / ".join(f"{m / ms[0] - 1:+.1%}" for m in ms[1:])
        a2a = " / ".join(f"{x['a2a']:.0f}" for x in sims)  # type: ignore[index]
        peak = " / ".join(format_bytes(x["peak"]).replace(" GiB", "")  # type: ignore[index]
                          for x in sims)
        out.append(f"| {r['model']} | {r['tp']} | {c.a2a / c.f:.2f} "  # type: ignore[attr-defined]
                   f"| {ms[0]:.0f} | {ms[1]:.0f} | {ms[2]:.0f} | {ms[3]:.0f} | {gains} "
                   f"| {a2a} | {peak} GiB | {_why(r)} |")
    return out


SWEEP = (0.0, 0.5, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
"""a2a / f of the uniform-cost sweep."""


def sweep() -> list[str]:
    """STP against braided DualPipeV as the all-to-all grows past the compute that
    hides it: uniform costs (f = 1, b = 1.05, w = 0.95, about the presets' ratios), PP 4,
    m 16, four layers a chunk."""
    out = ["| a2a / f | STP | DualPipeV | STP vs DPV | exposed a2a STP / DPV | "
           "pipeline bubble STP / DPV |", "|---:|---:|---:|---:|---|---|"]
    for x in SWEEP:
        got = {}
        for name in ("stp", "dualpipev"):
            res = simulate(generate(name, PP, MICROBATCHES), Costs(f=1, b=1.05, w=0.95, a2a=x),
                           layers=4, record_spans=False)
            got[name] = (res.makespan, res.critical_rank.exposed_a2a, res.critical_rank.idle)
        (sm, se, si), (dm, de, di) = got["stp"], got["dualpipev"]
        out.append(f"| {x:g} | {sm:.2f} | {dm:.2f} | {dm / sm - 1:+.1%} | {se:.2f} / {de:.2f} "
                   f"| {si:.2f} / {di:.2f} |")
    return out


NOTES = [
    "## Reading the table",
    "",
    "- Step times in ms of one iteration (the critical rank's span). `STP vs X`: X's "
    "step over STP's minus one (positive: STP is faster). `exposed a2a`: all-to-all "
    "time the critical rank waits for, in ms (what braiding did not hide); the rest "
    "of each rank's all-to-all ran under the partner microbatch's compute.",
    "- `a2a / f`: one F pass's all-to-all time over its compute, per rank share. At TP 1 "
    "the EP group is one node and the all-to-all rides NVLink (small); at TP 2 and 4 it "
    "crosses the network at 50 GB/s per GPU while the compute shrinks by t, so it "
    "outgrows the compute that can hide it: no schedule hides all of it, and what is "
    "left exposed decides the ranking.",
    "- Why STP beats 1F1B-I and ZB-V: a forward on its own exposes its all-to-alls (and "
    "all-reduces); 1F1B-I braids nothing (its B's collectives hide under its own W "
    "only), ZB-V defers W so both F's and B's are exposed, while STP braids every "
    "steady-state F with a B and exposes only its warm-up forwards'.",
    "- Why STP loses to braided DualPipeV at TP 4 (Mixtral -0.6%, Qwen2 -3.9%): both "
    "braid a forward with a backward, so both hide the steady state's collectives, "
    "and while the all-to-all is shorter than the compute it hides under STP exposes "
    "fewer of them (its ramps run fewer passes alone) and has the shorter bubble. "
    "Once one pass's all-to-all outgrows its compute (a2a / f of 1.22 and 3.48 at TP "
    "4), the collective lane, not the compute, bounds the step: every rank's lane is "
    "busy nearly all the time under either schedule, so both expose the same "
    "all-to-all (1055 vs 1052 ms on Qwen2's critical rank), and what is left is the "
    "pipeline bubble of the ramps, where DualPipeV's is shorter (91 ms on Qwen2). The "
    "sweep below shows the switch on uniform costs: STP ahead up to a2a / f = 1.25, "
    "DualPipeV ahead from about 1.5 (with TP > 1 the all-reduce shares the lane, so "
    "the presets switch earlier: Mixtral at 1.22). The `why` column names, from the critical "
    "ranks, how much less exposed collective time and pipeline bubble each side has.",
    "- Peak memory: STP keeps about 3p chunk activations against DualPipeV's 2p + 1 "
    "and ZB-V's 2p, the price of its shorter bubble (the STP paper reports the same "
    "and cuts it with offload, `--offload`). At TP 1 Mixtral's STP peak (92.5 GiB) "
    "and every Qwen2 row at TP 1 exceed an 80 GB H100: these settings need TP 2, "
    "offload or recomputation.",
    "- The simulator hides a collective completely once it runs under another unit's "
    "compute; on GPUs NCCL shares SMs and memory bandwidth with that compute, so the "
    "hidden fraction measured (`stp bench overlap`) is lower, and the gains from "
    "hiding are an upper bound. Routing is taken as balanced (each EP rank receives "
    "what it sends); a skewed router lengthens the slowest rank's all-to-all. "
    "Dispatch in 16 bits (DeepSeek-V3 dispatches in FP8, halving the bytes).",
    "",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_sim.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [run_setting(model, tp) for model in MODELS for tp in TPS]
    lines = ["# STP on mixtures of experts (simulated)", "",
             "Generated by `python3 benchmarks/bench_moe_sim.py` (the module doc says how). "
             f"{HARDWARE} nodes of 8 GPUs, EP {EP} (dp {PP_DP}), PP {PP}, m {MICROBATCHES} "
             "microbatches of one 4096-token sequence, bfloat16, sharded optimizer; "
             "every schedule with two chunks per rank and the even partition.", ""]
    lines += table(rows) + [""] + NOTES
    lines += ["## STP against DualPipeV as the all-to-all grows (uniform costs)", "",
              "f = 1, b = 1.05, w = 0.95 per rank share (about the presets' ratios), a2a as "
              "given, no all-reduce; PP 4, m 16, four layers a chunk.", ""]
    lines += sweep() + [""]
    lines.append(f"Total time: {time.perf_counter() - t0:.0f} s on one core.")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
