"""STP against braided DualPipeV in the simulator: where each wins, at what memory.

Both schedules put two chunks per rank in a V and pair a forward with a
backward of another microbatch. STP ("Synergistic Tensor and Pipeline
Parallelism", arXiv 2510.27257) braids its pairs unit by unit to hide the TP
all-reduces; DualPipeV ("DeepSeek-V3 Technical Report", arXiv 2412.19437;
PyTorch's ScheduleDualPipeV order) pairs F&B to hide expert all-to-all. In
stp a DualPipeV pair is a braided block too (`stp.schedule.gen_dualpipe`),
so both hide all-reduce under the partner pass; what differs is the order
around the pairs: how many pairs there are, where the W go, how long the
warm-up and drain are, and how much is alive at once.

Settings:
* the STP paper's LLM settings: the `qwen2-12.1b` preset, TP 8, PP 2 and 4,
  sequence 2048 and 6144 (A800 preset, `stp.costmodel`), m = 4 PP,
  `layers / (2 PP)` layers per chunk;
* the `mllm-qwen2vl-7b` preset (448 x 448 images), TP 4 and 8, PP 2 and 4,
  every schedule with its own `--partition auto`;
* uniform costs f = b = w = 1 (the STP paper's table) and f = b = 1, w = 0.5
  (W about half of F, as Zero Bubble's profile), `ar / f` from 0 to 1,
  PP 2 and 4, m = 4 PP, 4 layers per chunk.

Writes benchmarks/results/dualpipev.md (and prints it).

    python3 benchmarks/bench_dualpipev.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from stp.costmodel import HARDWARE, derive, parse_hardware, parse_model
from stp.costmodel.mllm.costs import mllm_layered_costs
from stp.files import write_text_atomic
from stp.schedule import Block, Schedule, generate
from stp.search.partition import auto_partition
from stp.sim import Costs, MemCosts, simulate
from stp.sim.result import SimResult

PAIR = ("stp", "dualpipev")
MICROBATCHES_PER_RANK = 4
UNIFORM_LAYERS = 4
AR_STEPS = [i / 10 for i in range(11)]


def pass_by_pass(sch: Schedule) -> Schedule:
    """The same order with every braided pair run as its two passes in turn
    (forward first): DualPipeV without the braid, for reference."""
    return replace(sch, name=sch.name + "-sequential", actions=tuple(
        tuple(q for a in acts for q in (a.passes if isinstance(a, Block) else (a,)))
        for acts in sch.actions))


def _row(label: str, res: dict[str, SimResult], sequential: float) -> dict[str, object]:
    s, d = res["stp"], res["dualpipev"]
    return {
        "setting": label,
        "stp": s.makespan, "dualpipev": d.makespan, "sequential": sequential,
        "gain": d.makespan / s.makespan - 1,
        "tp": (s.tp_bubble, d.tp_bubble), "pp": (s.pp_bubble, d.pp_bubble),
        "peak": (max(s.peak_activation), max(d.peak_activation)),
        "why": _why(s, d),
    }


def _why(s: SimResult, d: SimResult) -> str:
    """The winner's larger saving, from the critical ranks' accounts."""
    dtp, dpp = d.tp_bubble - s.tp_bubble, d.pp_bubble - s.pp_bubble
    if abs(d.makespan - s.makespan) <= 1e-9 * d.makespan:
        return "tie"
    if s.makespan < d.makespan:
        return ("STP hides more all-reduce" if dtp >= dpp
                else "STP has less pipeline bubble")
    return ("DualPipeV has less pipeline bubble" if -dpp >= -dtp
            else "DualPipeV hides more all-reduce")


def llm_rows() -> list[dict[str, object]]:
    rows = []
    for pp in (2, 4):
        for seq in (2048, 6144):
            spec = parse_model(f"qwen2-12.1b,tp=8,sequence={seq}")
            d = derive(spec, HARDWARE["a800-80g"], pp)
            m, layers = MICROBATCHES_PER_RANK * pp, max(1, spec.layers // (2 * pp))
            res = {n: simulate(generate(n, pp, m), d.costs, d.mem, layers, record_spans=False)
                   for n in PAIR}
            seq_run = simulate(pass_by_pass(res["dualpipev"].schedule), d.costs, d.mem, layers,
                               record_spans=False)
            rows.append(_row(f"qwen2-12.1b TP8 PP{pp} seq {seq} (m {m}, ar/f "
                             f"{d.costs.ar / d.costs.f:.2f})", res, seq_run.makespan))
    return rows


def mllm_rows() -> list[dict[str, object]]:
    rows = []
    hw = parse_hardware("a800-80g")
    for tp in (4, 8):
        for pp in (2, 4):
            model = parse_model(f"mllm-qwen2vl-7b,tp={tp},resolution=448")
            d = derive(model, hw, pp)
            layered = mllm_layered_costs(model, hw, pp, d.costs, d.mem)
            m = MICROBATCHES_PER_RANK * pp
            found = {n: auto_partition(generate(n, pp, m), layered, model.total_layers)
                     for n in PAIR}
            res = {n: got.result for n, got in found.items()}
            dpv = found["dualpipev"].result
            seq_run = simulate(pass_by_pass(dpv.schedule), stages=dpv.stages, record_spans=False)
            rows.append(_row(f"mllm-qwen2vl-7b TP{tp} PP{pp} (m {m}, ar/f "
                             f"{d.costs.ar / d.costs.f:.2f})", res, seq_run.makespan))
    return rows


def uniform_rows(w: float) -> list[dict[str, object]]:
    rows = []
    for pp in (2, 4):
        m = MICROBATCHES_PER_RANK * pp
        for ar in AR_STEPS:
            c = Costs(1, 1, w, ar=ar)
            res = {n: simulate(generate(n, pp, m), c, MemCosts(), UNIFORM_LAYERS,
                               record_spans=False) for n in PAIR}
            seq_run = simulate(pass_by_pass(res["dualpipev"].schedule), c, MemCosts(),
                               UNIFORM_LAYERS, record_spans=False)
            rows.append(_row(f"PP{pp} m {m} ar/f {ar:.1f}", res, seq_run.makespan))
    return rows


def table(rows: list[dict[str, object]]) -> list[str]:
    out = ["| setting | STP | DualPipeV | STP gain | DPV pass by pass | TP bubble STP / DPV | "
           "PP bubble STP / DPV | peak M_B STP / DPV | why |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tp, pp, pk = r["tp"], r["pp"], r["peak"]
        out.append(f"| {r['setting']} | {r['stp']:.4g} | {r['dualpipev']:.4g} "
                   f"| {r['gain']:+.1%} | {r['sequential']:.4g} "
                   f"| {tp[0]:.3g} / {tp[1]:.3g} "  # type: ignore[index]
                   f"| {pp[0]:.3g} / {pp[1]:.3g} | {pk[0]:.3g} / {pk[1]:.3g} "  # type: ignore[index]
                   f"| {r['why']} |")
    return out


INTRO = """\
Generated by `python3 benchmarks/bench_dualpipev.py`. Makespan of one
iteration (ms for the presets, cost units for uniform costs) of STP and of
braided DualPipeV (its F&B pairs run unit by unit like STP's blocks, so
both hide TP all-reduce under the partner pass). `STP gain`: DualPipeV's
makespan over STP's, minus one (positive: STP is faster). TP bubble:
exposed all-reduce on the critical rank; PP bubble: its idle time; peak:
activations alive at once on the worst rank, in M_B (one microbatch
through a rank's whole share). `why`: the larger of the two savings of the
winner."""

FINDINGS = """\
## Where STP wins, where DualPipeV wins, and why

- **The STP paper's LLM settings (qwen2-12.1b, TP 8, ar/f 0.55 to 0.72): STP
  is 4.4% to 6.1% faster**, because it hides more all-reduce: its exposed
  TP time is about half of DualPipeV's (PP 4: 78 against 157 ms at sequence
  6144). STP braids almost every pass of its steady phase, its W included
  (F with W, or inside a full backward), so its exposed all-reduce stays
  about `(2p+1) T_AR` whatever m. DualPipeV braids only its main step and
  the B1-F1B0 steps; the warm-up (F0, F0F1, I1W1F1) and the drain (B1B0,
  W0B0, W0) run passes alone, each waiting for its own all-reduces.
- **Multimodal (mllm-qwen2vl-7b): STP +2.5% at TP 4 (ar/f 0.30); at TP 8
  (ar/f 0.86) DualPipeV is ahead by 0.3%.** There the vision encoder makes
  the first stage long and the all-reduce large: with its own
  `--partition auto` DualPipeV's partition leaves less pipeline bubble (PP 4:
  11 against 38 ms) and its exposed TP time is also lower at PP 2; the
  margin is within what the one-layer-at-a-time partition search moves.
- **Uniform costs: STP wins at every ar/f from 0 to 1**, by 1.8% (PP 2) and
  2.7% (PP 4) at ar = 0 growing to 8.5% and 9.2% at ar/f = 1 with
  f = b = w; with w = f/2 by 0.6% to 4.5%. The margin grows with ar/f
  because DualPipeV's TP bubble is about twice STP's (PP 4: `4.5 ar` against
  `9 ar` with f = b = w); with w = f/2, past ar/f = 0.5 (ar > w) the W
  units STP pairs with a forward are too short to cover its all-reduce,
  STP's TP bubble grows faster and the margin stops growing.
- **At ar = 0 the braid costs DualPipeV time.** Run pass by pass, DualPipeV
  equals STP with f = b = w and beats it with w = f/2 (42.25 against 43.19
  at PP 4); braided it is 2 to 3% slower. A braided pair computes the same
  and waits on no all-reduce, but each pass's output is final only when its
  last unit has run, near the end of the pair, where pass by pass the
  forward's output leaves before the backward runs; where those outputs are
  on DualPipeV's critical path the delay adds up. From ar/f = 0.1 to 0.2 on,
  braided DualPipeV beats pass-by-pass DualPipeV, which is up to 31% slower
  at ar/f = 1.
- **Memory: DualPipeV is lighter.** Its peak is `p + 1/2` M_B on every rank
  (the DualPipe README's PP+1 chunk activations); STP's is `1.5p + 1/2` M_B
  on rank 0 (3.5 against 2.5 at PP 2, 6.5 against 4.5 at PP 4; 7.34
  against 4.5 on the 12.1B preset, whose W keep 0.84 M_B). Every STP win
  above costs about `p/2` M_B more per rank; at DualPipeV's memory, STP
  needs activation offload (`--offload stp`) or the search.
- These are simulated figures: an all-reduce under compute is hidden
  completely here, while on GPUs the two share SMs and memory bandwidth, so
  the braided gains (both schedules') are upper bounds."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dualpipev.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    lines = ["# STP vs braided DualPipeV (simulated)", "", INTRO, "",
             "## The STP paper's LLM settings (qwen2-12.1b, A800, TP 8)", ""]
    lines += table(llm_rows())
    lines += ["", "## Multimodal (mllm-qwen2vl-7b, 448 x 448 images, `--partition auto`)",
              ""]
    lines += table(mllm_rows())
    for w, what in ((1.0, "f = b = w = 1 (the STP paper's table)"),
                    (0.5, "f = b = 1, w = 0.5")):
        lines += ["", f"## Uniform costs, {what}, {UNIFORM_LAYERS} layers per chunk", ""]
        lines += table(uniform_rows(w))
    lines += ["", FINDINGS, "", f"Total time: {time.perf_counter() - t0:.0f} s on one core."]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
