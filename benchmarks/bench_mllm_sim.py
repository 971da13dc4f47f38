"""STP's simulated gain on a multimodal model, next to the STP paper's +16%.

"Synergistic Tensor and Pipeline Parallelism" (arXiv 2510.27257) reports its
largest gain, +16% throughput over the best of 1F1B-I and ZB-V, on
multimodal LLMs (a ViT feeding a Qwen2 decoder). This benchmark simulates
the `mllm-qwen2vl-7b` preset (Qwen2-VL-7B's shapes, `stp.costmodel.mllm`) on
A800s at TP 4 and 8, PP 2 and 4, with `--partition auto` for every schedule
(encoder blocks and decoder layers cut by the simulator's judgement,
`stp.search.partition`), and prints STP's gain over the faster of
1f1b-interleaved and zb-v, as `stp compare --model mllm-qwen2vl-7b
--partition auto --json` does (`stp_gain_over_best_baseline`).

Writes benchmarks/results/mllm_sim.md (and prints it).

    python3 benchmarks/bench_mllm_sim.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from stp.costmodel import derive, parse_hardware, parse_model
from stp.costmodel.mllm.costs import mllm_layered_costs
from stp.files import write_text_atomic
from stp.schedule import generate
from stp.search.partition import auto_partition

PAPER_GAIN = 0.16
HARDWARE = "a800-80g"
SCHEDULES = ("1f1b-interleaved", "zb-v", "stp")
TPS, PPS = (4, 8), (2, 4)
MICROBATCHES_PER_RANK = 4
RESOLUTIONS = (448, 896)
"""The preset's 448 x 448 images (256 image tokens) and 896 x 896 (1024):
the encoder's share of the work grows with the resolution."""


def run_setting(resolution: int, tp: int, pp: int) -> dict[str, object]:
    model = parse_model(f"mllm-qwen2vl-7b,tp={tp},resolution={resolution}")
    hw = parse_hardware(HARDWARE)
    d = derive(model, hw, pp)
    layered = mllm_layered_costs(model, hw, pp, d.costs, d.mem)
    m = MICROBATCHES_PER_RANK * pp
    row: dict[str, object] = {"resolution": resolution, "tp": tp, "pp": pp, "m": m}
    spans: dict[str, float] = {}
    for name in SCHEDULES:
        got = auto_partition(generate(name, pp, m), layered, model.total_layers)
        row[name] = spans[name] = got.result.makespan
        row[f"{name}_peak"] = max(got.result.peak_activation)
        row[f"{name}_part"] = ",".join(map(str, got.counts))
    row["gain"] = min(spans["1f1b-interleaved"], spans["zb-v"]) / spans["stp"] - 1
    return row


def table(rows: list[dict[str, object]]) -> list[str]:
    out = ["| resolution | TP | PP | m | 1F1B-I (ms) | ZB-V (ms) | STP (ms) | STP gain | "
           "paper | peak 1F1B-I / ZB-V / STP (M_B) | STP partition |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(
            f"| {r['resolution']} | {r['tp']} | {r['pp']} | {r['m']} "
            f"| {r['1f1b-interleaved']:.0f} | {r['zb-v']:.0f} | {r['stp']:.0f} "
            f"| {r['gain']:+.1%} | {PAPER_GAIN:+.0%} "
            f"| {r['1f1b-interleaved_peak']:.2f} / {r['zb-v_peak']:.2f} / {r['stp_peak']:.2f} "
            f"| {r['stp_part']} |")
    return out


NOTES = [
    "## Why the figures differ from the paper's",
    "",
    "- **All-reduces.** The simulator hides an all-reduce completely whenever "
    "the braided schedule overlaps it with another unit's compute; on GPUs the two "
    "share SMs and memory bandwidth, so overlapped communication still slows the "
    "compute a little. Gains here that come from hidden TP communication are an "
    "upper bound of that part.",
    "- **Costs from FLOP counts.** Every pass time is matmul FLOPs over an assumed "
    "50% of the A800's 312 TFLOP/s peak, the same for thin encoder blocks (width "
    "1280) and wide decoder layers (3584, FFN 18944); really the thin blocks run "
    "at a lower efficiency, which makes the encoder's stages heavier than modelled. "
    "Link bandwidths (130 GB/s NVLink one way, 25 GB/s between stages) are "
    "assumed as well.",
    "- **Unknown shapes.** The paper does not give the images per sample, their "
    "resolution, the text length, the microbatch count or the Qwen2-VL size of its "
    "multimodal runs; we take one image, 2048 text tokens, m = 4 PP and the "
    "Qwen2-VL-7B shapes. At TP 8 the decoder's 28 heads do not split evenly (some "
    "ranks hold 4, some 3): the model assumes 1/8 of the attention per rank.",
    "- **Partition.** Every schedule here gets the partition `--partition auto` "
    "finds for it (the encoder on the first stage with few decoder layers, the "
    "output layer's stage lighter); a baseline with a naive split would lose more, "
    "and the paper's own baselines' partition is not stated. The search moves one "
    "layer at a time from the better of the even and the balanced split, so it can "
    "stop at a local optimum, differently for each schedule: part of the spread "
    "between rows is the partition search, not the schedule.",
    "",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "mllm_sim.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [run_setting(res, tp, pp) for res in RESOLUTIONS for tp in TPS for pp in PPS]
    lines = ["# STP on a multimodal model (simulated)", "",
             "Generated by `python3 benchmarks/bench_mllm_sim.py`. Step time (makespan) "
             f"of one iteration on `mllm-qwen2vl-7b` ({HARDWARE}, one image per sample, "
             "2048 text tokens, microbatch 1), every schedule with its own `--partition "
             "auto` (layers per global stage, 32 encoder blocks first, then 28 decoder "
             "layers; V schedules put stage 0 and the last stage on rank 0). `STP gain`: "
             "the faster of 1F1B-I and ZB-V over STP, minus one (`stp compare --json`'s "
             "`stp_gain_over_best_baseline`); `paper`: the STP paper's reported gain on "
             "multimodal LLMs (arXiv 2510.27257). No memory limit: STP's higher peak is "
             "the price the paper reports too.", ""]
    lines += table(rows) + [""] + NOTES
    lines.append(f"Total time: {time.perf_counter() - t0:.0f} s on one core.")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
