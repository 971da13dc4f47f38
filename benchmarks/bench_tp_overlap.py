"""Braiding against in-layer TP overlap, and the two combined (simulated).

"Synergistic Tensor and Pipeline Parallelism" (arXiv 2510.27257) compares
STP with 1F1B-I and ZB-V whose TP collectives are fully exposed. The
stronger alternative is in-layer TP overlap (Megatron-LM's
`--tp-comm-overlap`, torchtitan's async TP, FLUX: each unit's all-gather and
reduce-scatter cut into K chunks under the chunks' matmuls) with Zero
Bubble's ZB-V. This benchmark prices both, and the hybrid (braided blocks
kept, the passes that run alone chunked), with the simulator and the cost
model (`stp.sim.inlayer`, `stp.costmodel.inlayer`; docs/schedules.md,
"In-layer TP overlap, and how it is priced"):

* models on H100s (`h100-80g`, its assumed chunk launch cost and matmul
  efficiency curve): qwen2-12.1b TP8 PP2 and PP4 at sequence 6144 (the STP
  paper's setting), mllm-qwen2vl-7b TP8 PP4, qwen2-72b TP8 PP8 at 4096,
  llama3-405b TP8 PP16 at 8192; microbatch 1, m = 4 PP microbatches,
  sequence parallelism on (in-layer overlap chunks its collectives; it
  costs no time and holds fewer activations), bfloat16, the even layer
  split; step time = the simulated pipeline (no DP sync) and peak memory =
  `stp memory`'s estimate of the fullest pipeline rank. With sequence
  parallelism the weight-gradient pass W gathers its input again (the
  runtime keeps only the s/t shard from F): every row charges that gather,
  the rows without overlap whole (`--tp-overlap-chunks 1`: no chunk, the
  gather exposed where W runs alone, hidden nowhere), so the modes are
  compared on the same work;
* uniform costs (`stp compare --cost f=1,b=1,w=1,ar=R`) at all-reduce /
  compute ratios R = 0.1, 0.25, 0.5, 1.0, p = 4, m = 16, two layers a chunk,
  chunks free (no launch cost, no efficiency lost: in-layer overlap's best
  case); peak in units of one microbatch's activations (M_B). Without
  sequence parallelism nothing is gathered again in W, but in-layer overlap
  needs it, so its rows pay W's gather (half an all-reduce per unit, chunked).

Writes benchmarks/results/tp_overlap.md (and prints it). Deterministic.

    PYTHONPATH=src python3 benchmarks/bench_tp_overlap.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from stp.costmodel import derive, parse_hardware, parse_model
from stp.costmodel.inlayer import in_layer_for
from stp.costmodel.memory import Features, Layout, estimate_run
from stp.costmodel.mllm.costs import mllm_layered_costs
from stp.costmodel.mllm.spec import MLLMSpec
from stp.files import write_text_atomic
from stp.schedule import generate
from stp.sim import Costs, MemCosts, SimResult, simulate
from stp.sim.inlayer import InLayer
from stp.sim.layered import even_partition

HARDWARE = "h100-80g"
CHUNKS = (2, 4, 8)
GIB = float(1 << 30)


@dataclass(frozen=True)
class Row:
    """One line of a table: a schedule in one overlap mode."""

    label: str
    schedule: str
    braid: bool = True
    chunks: int = 0


ROWS = (
    Row("1F1B-I", "1f1b-interleaved"),
    Row("ZB-V", "zb-v"),
    *(Row(f"ZB-V + in-layer K={k}", "zb-v", chunks=k) for k in CHUNKS),
    Row("DualPipeV braided", "dualpipev"),
    Row("STP (braided)", "stp"),
    *(Row(f"STP + in-layer K={k} (both)", "stp", chunks=k) for k in CHUNKS),
    Row("STP in-layer K=4, braiding off", "stp", braid=False, chunks=4),
)
"""The rows of every table (the last: STP's blocks unbraided, every pass chunked)."""

SETTINGS = (
    ("qwen2-12.1b", 8, 2, 6144),
    ("qwen2-12.1b", 8, 4, 6144),
    ("mllm-qwen2vl-7b", 8, 4, None),
    ("qwen2-72b", 8, 8, 4096),
    ("llama3-405b", 8, 16, 8192),
)
"""(preset, tp, pp, sequence or None for the preset's own)."""

RATIOS = (0.1, 0.25, 0.5, 1.0)


def model_row(name: str, tp: int, pp: int, seq: int | None, row: Row) -> tuple[float, float]:
    """(step ms, peak GiB of the fullest rank) of one row on one model."""
    fields = f",tp={tp}" + (f",sequence={seq}" if seq else "")
    spec = parse_model(name + fields)
    if isinstance(spec, MLLMSpec):
        return _mllm_row(spec, pp, row)
    seq_len = seq or spec.sequence  # type: ignore[union-attr]
    layout = Layout(pp=pp, tp=tp, dp=1, microbatches=4 * pp, microbatch_size=1,
                    seq_len=seq_len, schedule=row.schedule)
    # K = 1 on rows without overlap: their W gathers its input again, whole (module doc)
    feats = Features(sequence_parallel=True, braid=row.braid,
                     tp_overlap_chunks=row.chunks or 1)
    est, res = estimate_run(spec, parse_hardware(HARDWARE), layout, feats)
    return res.makespan, est.peak.total / GIB


def _mllm_row(spec: MLLMSpec, pp: int, row: Row) -> tuple[float, float]:
    """The multimodal model: its 28 heads do not split over TP 8, which the memory
    estimate refuses, so the step is simulated from its per-stage costs (the even
    split of encoder blocks and decoder layers; its formulas count all-reduces, no
    sequence parallelism) and the peak is the activations alone."""
    hw = parse_hardware(HARDWARE)
    d = derive(spec, hw, pp)
    sch = generate(row.schedule, pp, 4 * pp)
    table = mllm_layered_costs(spec, hw, pp, d.costs, d.mem).table(
        even_partition(spec.total_layers, sch.num_stages))
    res = simulate(sch, stages=table, record_spans=False, braid=row.braid,
                   in_layer=in_layer_for(spec, hw, row.chunks or 1))
    return res.makespan, max(res.peak_activation) * d.bytes_per_unit / GIB


def uniform_row(ratio: float, row: Row) -> SimResult:
    sch = generate(row.schedule, 4, 16)
    plan = InLayer(row.chunks) if row.chunks else None
    return simulate(sch, Costs(f=1, b=1, w=1, ar=ratio), MemCosts(m_b=1, m_w=0.5), layers=2,
                    record_spans=False, braid=row.braid, in_layer=plan)


def _table(head: str, cells: list[tuple[Row, float, float]], unit: str, mem: str) -> list[str]:
    best = min(t for _, t, _ in cells)
    base = min(t for r, t, _ in cells if r.label in ("1F1B-I", "ZB-V"))
    out = [f"| {head} | step ({unit}) | vs best of 1F1B-I, ZB-V | peak ({mem}) |",
           "|---|---:|---:|---:|"]
    for row, t, peak in cells:
        mark = " **fastest**" if t == best else ""
        step = f"{t:.0f}" if t >= 1000 else f"{t:.4g}"
        out.append(f"| {row.label}{mark} | {step} | {base / t - 1:+.1%} | {peak:.3g} |")
    return out


Cells = list[tuple[Row, float, float]]


def model_tables(summary: list[tuple[str, Cells]]) -> list[str]:
    out = []
    for name, tp, pp, seq in SETTINGS:
        cells = [(row, *model_row(name, tp, pp, seq, row)) for row in ROWS]
        title = f"{name} TP{tp} PP{pp}" + (f", sequence {seq}" if seq else "")
        out += [f"### {title}, m = {4 * pp}", ""]
        out += _table("schedule", cells, "ms", "GiB") + [""]
        summary.append((title, cells))
    return out


def uniform_tables(summary: list[tuple[str, Cells]]) -> list[str]:
    out = []
    for ratio in RATIOS:
        cells = []
        for row in ROWS:
            res = uniform_row(ratio, row)
            cells.append((row, res.makespan, max(res.peak_activation)))
        out += [f"### all-reduce / compute = {ratio:g} (`--cost f=1,b=1,w=1,ar={ratio:g}`)", ""]
        out += _table("schedule", cells, "cost units", "M_B") + [""]
        summary.append((f"uniform, ar / compute = {ratio:g}", cells))
    return out


def _best(cells: Cells, prefix: str) -> tuple[Row, float]:
    row, t, _ = min((c for c in cells if c[0].label.startswith(prefix)), key=lambda c: c[1])
    return row, t


def summary_table(summary: list[tuple[str, Cells]]) -> list[str]:
    """Per setting: the fastest row; STP braided against ZB-V with its best K (the
    question of the STP paper's reviewers); the hybrid's best K against STP braided."""
    out = ["| setting | fastest | STP braided vs ZB-V + in-layer (best K) | "
           "STP + in-layer (best K) vs STP braided |", "|---|---|---|---|"]
    for title, cells in summary:
        fastest = min(cells, key=lambda c: c[1])[0].label
        stp = next(t for r, t, _ in cells if r.label == "STP (braided)")
        zrow, zbv = _best(cells, "ZB-V + in-layer")
        hrow, hyb = _best(cells, "STP + in-layer")
        out.append(f"| {title} | {fastest} | {zbv / stp - 1:+.1%} (K={zrow.chunks}) | "
                   f"{stp / hyb - 1:+.1%} (K={hrow.chunks}) |")
    return out + ["", "Percentages: the second's step over the first's, minus one "
                  "(positive: the first is faster).", ""]


PROSE = """\
## Where each wins, and why

- **ZB-V + in-layer overlap is the strong alternative the STP paper did not
  measure.** ZB-V has no braided block, so without overlap every pass waits
  for its collectives (4m exposed all-reduce times in the STP paper's count)
  and it is the slowest V here; chunked, a unit exposes only its first
  gather piece and its last scatter piece, plus (K-1) extra collective
  launches and the matmul efficiency lost at s/K rows. That closes most of
  the gap to STP: on the qwen2-12.1b PP2 and llama3-405b settings ZB-V + in-layer
  (best K) ties or beats STP braided, and with free chunks (uniform tables)
  it beats STP braided at every ratio; on qwen2-72b PP8 STP keeps a clear
  lead (its blocks hide whole collectives, at full-size matmuls, in the
  steady state that dominates a deep pipeline with m = 4 PP).
- **Braiding hides whole collectives at no matmul cost; chunking hides all but
  a piece of each, at a matmul cost.** The two compose: STP + in-layer (the
  hybrid, braided blocks kept, lone passes chunked) is the fastest row on
  every decoder model here, 4-12% ahead of STP braided alone, because a V's
  warm-up and cool-down passes (and the passes of W alone) have no partner
  to braid with. With free chunks (uniform tables) the hybrid is fastest at
  every ratio, and its lead over STP braided grows with the ratio.
- **K is a trade.** K = 8 exposes 1/8 of a collective but runs s/8-row
  matmuls (0.9 of the large-matrix rate at 768 rows on the assumed curve)
  and pays 7 extra launches per collective: K = 4 is best or within 1% of
  it on every model setting, K = 8 wins only where chunks are free or long
  sequences keep s/8 rows large (qwen2-12.1b PP2), K = 2 on the multimodal
  model's hybrid.
- **Where STP loses or ties.** On the multimodal model DualPipeV braided is
  fastest, and STP with braiding off but every pass chunked beats STP
  braided: there the simulator finds STP's blocks hide less than chunking
  every pass (the even split puts thin encoder blocks and wide decoder
  layers in one pipeline; why braiding gains less there was not pulled
  apart). ZB-V + in-layer ties or beats STP braided where noted above. STP
  holds the most activations in every setting (the peak column: its blocks
  keep an extra microbatch in flight, 20% to 100% over ZB-V); where memory
  is the limit, ZB-V + in-layer overlap is the better trade.
- **Caveats.** Simulated only: overlapped communication is assumed not to
  slow the compute under it (on GPUs they share SMs and memory bandwidth,
  which taxes braiding and chunking alike); the chunk launch cost and the
  matmul efficiency curve of `h100-80g` are assumptions (`stp plan
  --hardware local` and `--calibrate` measure the curve on the machine they
  run on); the multimodal model's formulas count all-reduces without
  sequence parallelism, and its peak is activations only.
"""


MEASURED = "## Measured against predicted"


def measured_section(out: Path) -> str:
    """The file's measured section (written by hand from `stp bench fidelity
    --sequence-parallel`, not generated here), kept when the tables are regenerated."""
    old = out.read_text() if out.exists() else ""
    at = old.find("\n" + MEASURED)
    return "" if at < 0 else old[at:].lstrip("\n").rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp_overlap.md"))
    args = ap.parse_args()
    lines = ["# Braiding against in-layer TP overlap (simulated)", "",
             "Generated by `PYTHONPATH=src python3 benchmarks/bench_tp_overlap.py` "
             "(cost model and simulator only; deterministic). Step time of one iteration; "
             "`vs best of 1F1B-I, ZB-V`: the faster of the two plain baselines' step over "
             "the row's, minus one (higher is faster). Rows: `+ in-layer K` chunks the "
             "passes that run alone into K pieces (`stp simulate --tp-overlap "
             "--tp-overlap-chunks K`); on STP that is the hybrid (braided blocks kept), "
             "and the last row turns braiding off and chunks every pass. "
             "Settings and assumptions: the script's docstring.", "",
             ]
    summary: list[tuple[str, Cells]] = []
    tables = [f"## Models on {HARDWARE}", ""] + model_tables(summary)
    tables += ["## Uniform costs (p = 4, m = 16, two layers a chunk, chunks free)", ""]
    tables += uniform_tables(summary)
    lines += ["## Summary", ""] + summary_table(summary) + PROSE.splitlines() + [""]
    lines += tables
    text = "\n".join(lines) + "\n" + measured_section(Path(args.out))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
