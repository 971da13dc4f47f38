"""Memory against speed: ZB-V, 1F1B-I and STP with the levers every trainer has.

STP buys its speed with activation memory (about 3p chunk activations
against ZB-V's 2p; "Synergistic Tensor and Pipeline Parallelism", arXiv
2510.27257). This benchmark simulates, per schedule and lever set, the peak
bytes per rank (`stp.costmodel.memory.estimate`: weights, fp32 gradients,
masters and AdamW moments, the simulated peak activations, buffers; bf16)
and the step time, on the STP paper's LLM setting (`qwen2-12.1b`, TP 8,
PP 2, sequence 6144) and on `qwen2-72b` (TP 8, PP 4, sequence 4096), A800s,
m = 4 PP microbatches of one sequence, DP 4, the even layer partition.

Levers: nothing; sequence parallelism (Korthikanti et al., arXiv
2205.05198); SP + selective recomputation (same paper); SP + selective +
sharded optimizer (ZeRO stage 1, arXiv 1910.02054, over DP 4); offload of
chunk-0 activations (the STP paper's policy; PipeOffload, arXiv 2503.01328)
alone.

The questions (the memory issue's goal): does STP with SP and selective
recomputation fit within ZB-V's peak bytes without them; and, each lever set
given to every schedule, is STP at least 8% faster than the best baseline
that fits the same byte budget (ZB-V's peak without levers)?

Writes benchmarks/results/memory_tradeoff.md (and prints it).

    python3 benchmarks/bench_memory_tradeoff.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stp.costmodel import parse_hardware, parse_model
from stp.costmodel.memory import Features, Layout, MemoryEstimate, estimate
from stp.files import write_text_atomic

HARDWARE = "a800-80g"
SCHEDULES = ("zb-v", "1f1b-interleaved", "stp")
BASELINES = ("zb-v", "1f1b-interleaved")
GOAL = 0.08
DP = 4
SETTINGS = (("qwen2-12.1b", 2, 6144), ("qwen2-72b", 4, 4096))
"""(preset, PP, sequence); TP 8 throughout."""
LEVERS: dict[str, Features] = {
    "nothing": Features(),
    "SP": Features(sequence_parallel=True),
    "SP + selective": Features(sequence_parallel=True, recompute="selective"),
    "SP + selective + sharded opt.": Features(sequence_parallel=True, recompute="selective",
                                              shard_optimizer=True),
    "offload (chunk 0)": Features(offload="stp"),
}
GIB = 1 << 30


def run_setting(preset: str, pp: int, seq: int) -> dict[tuple[str, str], MemoryEstimate]:
    hw = parse_hardware(HARDWARE)
    out = {}
    for name in SCHEDULES:
        lay = Layout(pp=pp, tp=8, dp=DP, microbatches=4 * pp, seq_len=seq, schedule=name)
        for lever, feats in LEVERS.items():
            out[(name, lever)] = estimate(parse_model(preset), hw, lay, feats)
    return out


def _gain(stp_ms: float, baseline_ms: list[float]) -> str:
    return f"{min(baseline_ms) / stp_ms - 1:+.1%}" if baseline_ms else "no baseline fits"


def report(preset: str, pp: int, seq: int, got: dict[tuple[str, str], MemoryEstimate]) -> str:
    budget = got[("zb-v", "nothing")].peak.total
    lines = [f"### {preset}, TP 8, PP {pp}, sequence {seq}, m {4 * pp}, DP {DP} ({HARDWARE})",
             "", f"Budget: ZB-V's peak without levers, {budget / GIB:.2f} GiB per rank.", "",
             "| levers | schedule | peak GiB (rank) | activations GiB | step ms | "
             "tokens/s per GPU | fits budget |", "|---|---|---:|---:|---:|---:|---|"]
    tokens = 4 * pp * seq  # one replica's tokens per step, over its pp x tp GPUs
    for lever in LEVERS:
        for name in SCHEDULES:
            est = got[(name, lever)]
            peak = est.peak
            assert est.step_time is not None
            per_gpu = tokens / (est.step_time / 1e3) / (pp * 8)
            lines.append(f"| {lever} | {name} | {peak.total / GIB:.2f} ({peak.rank}) | "
                         f"{peak.activations_peak / GIB:.2f} | {est.step_time:.0f} | "
                         f"{per_gpu:.0f} | {'yes' if peak.total <= budget else 'no'} |")
    lines += ["", "STP against the fastest baseline that fits the budget, same levers:", "",
              "| levers | STP fits | STP step ms | best fitting baseline | gain | >= 8% |",
              "|---|---|---:|---|---:|---|"]
    for lever in LEVERS:
        stp = got[("stp", lever)]
        fits = [(got[(b, lever)].step_time, b) for b in BASELINES
                if got[(b, lever)].peak.total <= budget]
        best = min(fits) if fits else None
        gain = best[0] / stp.step_time - 1 if best else None  # type: ignore[operator]
        stp_fits = stp.peak.total <= budget
        lines.append(f"| {lever} | {'yes' if stp_fits else 'no'} | {stp.step_time:.0f} | "
                     f"{best[1] if best else '-'} | "
                     f"{'-' if gain is None else f'{gain:+.1%}'} | "
                     f"{'-' if gain is None else 'yes' if gain >= GOAL and stp_fits else 'no'} |")
    sp_sel = got[("stp", "SP + selective")].peak.total
    lines += ["", f"STP with SP + selective: {sp_sel / GIB:.2f} GiB against ZB-V without "
              f"levers {budget / GIB:.2f} GiB: "
              f"{'fits' if sp_sel <= budget else 'does not fit'}.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "memory_tradeoff.md"))
    args = ap.parse_args()
    parts = ["# Memory against speed: ZB-V, 1F1B-I and STP with the same levers", "",
             "Simulated (`python3 benchmarks/bench_memory_tradeoff.py`; "
             "`stp.costmodel.memory`). Bytes are per GPU of the rank that peaks; "
             "throughput is tokens per second per GPU.", ""]
    for preset, pp, seq in SETTINGS:
        parts.append(report(preset, pp, seq, run_setting(preset, pp, seq)))
    text = "\n".join(parts)
    write_text_atomic(args.out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
